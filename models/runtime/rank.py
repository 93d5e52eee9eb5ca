"""One rank: its shard of the model, the DTP forward with the exchange, and the generation loop.

The forward is the simulator's recurrence under the communication schedule (`models.schedules.grammar`) on
this rank's stream alone, as `models.runtime.arrivals` reads it off the table: after module n the
rank starts the exchange that n completes (the sum of the partials arriving together), and before
module t it adds its own partials due at t (scaled by s_m) and waits for the exchange due at t, only
then. The module math is the simulator's (`models.sim.partials.ShardedDecoder`) on this rank's weights.
The final norm is applied per rank and the normed states are summed onto rank 0, which applies the
LM head, chooses the next token and broadcasts it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from models.runtime.arrivals import ArrivalPlan
from models.runtime.errors import RankFailure, ShardError
from models.runtime.exchange import Exchange
from models.runtime.generation import (
    GenerateRequest,
    GenerationResult,
    LoadInfo,
    RankStats,
    schedule_delta,
    shard_error,
)
from models.runtime.group import RankGroup
from models.runtime.sampling import Sampling, next_tokens
from models.runtime.shards import (
    RankWeights,
    ShardSet,
    check_world_size,
    load_rank_tensors,
    read_shard_set,
    rotary_for,
)
from models.schedules.grammar import resolve_schedule
from models.sim.moe import routing_of
from models.sim.partials import DTPCache, ShardedDecoder, rms_norm

# How long a rank waits for the others to finish checking and loading their shards (hashing and reading a
# large shard can take minutes; a rank that dies meanwhile is noticed by its heartbeat, not this limit).
LOAD_TIMEOUT_S = 1800.0


class RankModel:
    """This rank's slice of the model, ready to run."""

    def __init__(self, shards: ShardSet, tensors: dict[str, torch.Tensor], *, rank: int,
                 device: torch.device) -> None:
        config, shape = shards.config, shards.shape
        self.rank = rank
        self.devices = shards.devices
        self.num_modules = 2 * shape.num_layers
        self.eps = float(config.rms_norm_eps)
        self.embed = tensors["model.embed_tokens.weight"]  # [V, D], replicated
        self.norm = tensors["model.norm.weight"]
        # The LM head is only applied on rank 0 (tied: the embedding).
        self.lm_head = tensors.get("lm_head.weight", self.embed) if rank == 0 else None
        # an MoE's expert slices stacked into the fused parameters the module math reads (models.sim.moe)
        tensors = shards.checkpoint.fused_state(tensors)
        self.decoder = ShardedDecoder(RankWeights(tensors, shards.family, shape.num_layers),
                                      head_dim=shape.head_dim, eps=self.eps, qk_norm=shards.family.qk_norm,
                                      rotary_emb=rotary_for(config, device),
                                      routing=routing_of(shards.family, config))

    def forward(self, ids: torch.Tensor, cache: DTPCache, plan: ArrivalPlan, exchange: Exchange, *,
                all_positions: bool) -> torch.Tensor | None:
        """ids: [B, S] -> logits on rank 0 ([B, S, V], or [B, 1, V] for the last position), None elsewhere."""
        emb = F.embedding(ids, self.embed)  # [B, S, D]
        cos, sin = self.decoder.rotary(ids, emb, cache.length)  # [B, S, hd]
        x = emb.unsqueeze(0)  # [1, B, S, D]: this rank's residual stream
        held: dict[int, torch.Tensor] = {}  # own partials not yet added to x, [1, B, S, D]
        sums: dict[int, torch.Tensor] = {}  # arrival point -> the sum of its exchange's own partials so far
        inflight = {}  # arrival point -> its started exchange
        for n in range(self.num_modules):
            partial = self.decoder.partials(n, x, cos, sin, cache)  # [1, B, S, D]
            held[n] = partial
            due = plan.others_due[n]
            if due is not None:
                sums[due] = partial if due not in sums else sums[due] + partial
                if plan.sends[n] == due:  # the last module of that exchange: start it now, wait at `due`
                    inflight[due] = exchange.start(sums.pop(due), due)
            arrival = plan.arrivals[n]  # before module n+1
            for m, scale in arrival.own:
                own = held.pop(m)
                x = x + (own * scale if scale != 1.0 else own)
            if arrival.exchange:
                total, own = exchange.wait(inflight.pop(n + 1))  # Σ_j Σ_m o_m^j and Σ_m o_m^l
                x = x + (total if arrival.whole else total - own)
            for m in plan.own_done[n]:
                held.pop(m, None)
        h = rms_norm(x[0], self.norm, self.eps)  # [B, S, D]
        if not all_positions:
            h = h[:, -1:]
        h = exchange.reduce_to_first(h.contiguous())
        if self.lm_head is None:
            return None
        return F.linear(h / self.devices, self.lm_head)


def _per_token(total_s: float, steps: int) -> float | None:
    return total_s * 1e3 / steps if steps else None


class RankWorker:
    """What a rank does on command: load shards (all ranks agree first), generate."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.model: RankModel | None = None
        self.info: LoadInfo | None = None

    def load(self, shards_dir: str) -> LoadInfo:
        """Check and load this rank's shard; every rank agrees before any is used (else ShardError on all).

        A failed load keeps whatever was loaded before.
        """
        group, t0 = self.group, time.perf_counter()
        error, loaded = None, None
        try:
            shards = read_shard_set(shards_dir)
            check_world_size(shards, group.world_size)
            tensors = load_rank_tensors(shards, group.rank, group.device)
            loaded = (shards, tensors)
        except ShardError as exc:
            error = str(exc)
        except Exception as exc:  # an unreadable file and the like: still a refusal before compute
            error = f"{type(exc).__name__}: {exc}"
        failures = group.agree(error, "agreeing that every rank loaded its shard",
                               timeout_s=max(LOAD_TIMEOUT_S, group.timeout_s))
        if failures:
            raise shard_error(failures)
        assert loaded is not None
        shards, tensors = loaded
        self.model = RankModel(shards, tensors, rank=group.rank, device=group.device)
        eos = shards.config.eos_token_id
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list | tuple) else [eos] if eos is not None else []))
        self.info = LoadInfo(
            rank=group.rank, device=str(group.device), shards_dir=str(shards_dir), model_type=shards.shape.model_type,
            layout=shards.layout.name, devices=shards.devices, delta=shards.delta, num_layers=shards.shape.num_layers,
            vocab_size=int(shards.config.vocab_size), eos_token_ids=eos_ids,
            dtype=str(next(iter(tensors.values())).dtype).removeprefix("torch."),
            shard_bytes=int(shards.files[group.rank]["size"]), load_s=time.perf_counter() - t0,
            schedule=shards.schedule)
        return self.info

    def _choose(self, logits: torch.Tensor | None, sampling: Sampling, generator: torch.Generator | None,
                finished: torch.Tensor, pad: int, exchange: Exchange) -> torch.Tensor:
        """Rank 0 picks the next tokens from its logits [B, V]; every rank gets them: [B]."""
        batch = finished.shape[0]
        if logits is not None:
            token = next_tokens(logits, sampling, generator)
            token = torch.where(finished, torch.full_like(token, pad), token)
        else:
            token = torch.empty(batch, dtype=torch.long, device=self.group.device)
        return exchange.broadcast_from_first(token)

    @torch.inference_mode()
    def generate(self, request: GenerateRequest, *, backend: str = "") -> GenerationResult | None:
        """Prefill, then cached decoding; rank 0 returns the result (with every rank's timings)."""
        if self.model is None or self.info is None:
            raise ValueError("no shards loaded: load a shards directory first")
        req = request.checked(self.info)
        model, device, rank = self.model, self.group.device, self.group.rank
        assert req.schedule is not None
        plan = ArrivalPlan.of(resolve_schedule(req.schedule, model.num_modules // 2, model.devices,
                                               req.last_scale))  # type: ignore[arg-type]
        exchange = Exchange(self.group, link_latency_us=req.link_latency_us)
        sampling = Sampling(req.temperature, req.top_k, req.seed)
        generator = sampling.generator(device) if rank == 0 and not sampling.greedy else None
        ids = torch.as_tensor(req.input_ids, dtype=torch.long, device=device)  # [B, S]
        stop = torch.as_tensor(list(req.stop_ids), dtype=torch.long, device=device)
        pad = int(req.stop_ids[0]) if req.stop_ids else 0
        finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
        cache = DTPCache()

        t0 = time.perf_counter()
        logits = model.forward(ids, cache, plan, exchange, all_positions=req.return_logits)
        prefill_logits = logits.float().cpu().numpy() if logits is not None and req.return_logits else None
        token = self._choose(None if logits is None else logits[:, -1], sampling, generator, finished, pad, exchange)
        finished |= torch.isin(token, stop)
        prefill_s, prefill_blocked = time.perf_counter() - t0, exchange.reset()

        tokens, step_logits = [token], []
        t1 = time.perf_counter()
        while len(tokens) < req.max_new_tokens and not bool(finished.all()):
            logits = model.forward(token[:, None], cache, plan, exchange, all_positions=True)
            if logits is not None and req.return_logits:
                step_logits.append(logits[:, -1].float().cpu().numpy())
            token = self._choose(None if logits is None else logits[:, -1], sampling, generator, finished, pad,
                                 exchange)
            finished |= torch.isin(token, stop)
            tokens.append(token)
        steps = len(tokens) - 1
        decode_s, blocked = time.perf_counter() - t1, exchange.reset()

        stats = RankStats(
            rank=rank, prefill_ms=prefill_s * 1e3, prefill_blocked_ms=prefill_blocked.total_s * 1e3,
            decode_steps=steps, ms_per_token=_per_token(decode_s, steps),
            blocked_ms_per_token=_per_token(blocked.total_s, steps),
            exchange_blocked_ms_per_token=_per_token(blocked.exchange_s, steps),
            exchanges_per_token=blocked.exchanges / steps if steps else None)
        all_stats = self.group.gather_objects(stats, "gathering the timings")
        if rank != 0:
            return None
        return GenerationResult(
            prompt_ids=req.input_ids, tokens=torch.stack(tokens, dim=1).cpu().numpy(), devices=model.devices,
            schedule=req.schedule, delta=schedule_delta(req.schedule), backend=backend or self.group.backend,
            link_latency_us=req.link_latency_us,
            sampling={"temperature": req.temperature, "top_k": req.top_k, "seed": req.seed},
            ranks=all_stats, prefill_logits=prefill_logits,
            step_logits=np.stack(step_logits) if step_logits else None)


# ---- a rank started by the launcher (models.runtime.launcher) --------------------------------------

def rank_main(rank: int, world_size: int, conn: Any, store_host: str, store_port: int, namespace: str,
              backend: str, timeout_s: float, threads: int) -> None:
    """A rank process: join the group, then serve the launcher's commands until `stop`.

    Replies: ("ok", value), ("shard_error" | "value_error", message) with the group intact, or
    ("rank_failure", message) after which the process exits. SIGINT is the launcher's to handle
    (it stops every rank), so a terminal's ctrl-C does not kill ranks mid-collective one by one.
    """
    import datetime

    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore(store_host, store_port, world_size=None, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        group = RankGroup(rank=rank, world_size=world_size, backend=backend, store=store, timeout_s=timeout_s,
                          namespace=namespace)
    except Exception as exc:
        conn.send(("rank_failure", f"rank {rank}: {exc}"))
        return
    conn.send(("ready", {"rank": rank, "pid": os.getpid(), "device": str(group.device)}))
    worker = RankWorker(group)
    while True:
        try:
            command, payload = conn.recv()
        except (EOFError, OSError):
            break  # the launcher is gone
        if command == "stop":
            break
        try:
            if command == "load":
                reply: tuple[str, Any] = ("ok", worker.load(payload))
            elif command == "generate":
                reply = ("ok", worker.generate(payload, backend=backend))
            else:
                reply = ("value_error", f"unknown command {command!r}")
        except ShardError as exc:
            reply = ("shard_error", str(exc))
        except RankFailure as exc:
            _exit_after(conn, ("rank_failure", str(exc)))
        except ValueError as exc:  # a bad request, refused identically by every rank before any collective
            reply = ("value_error", str(exc))
        except BaseException as exc:
            message = f"rank {rank}: {type(exc).__name__}: {exc}"
            group.record_failure(message)
            _exit_after(conn, ("rank_failure", message))
        conn.send(reply)
    # Stopping: every rank leaves at once, so there is nothing to tear down collectively; exiting without
    # the interpreter's slow teardown (torch, transformers) keeps stop() well under a second.
    group.stop_heartbeat()
    with contextlib.suppress(OSError):
        conn.close()
    sys.stderr.flush()
    os._exit(0)


def _exit_after(conn: Any, reply: tuple[str, Any]) -> None:
    """Send the last reply and leave at once: the group is broken, and tearing it down could block."""
    with contextlib.suppress(Exception):
        conn.send(reply)
    sys.stderr.flush()
    os._exit(1)
