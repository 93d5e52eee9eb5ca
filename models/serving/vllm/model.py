"""DTP models for vLLM: the family's own vLLM decoder layers (fused qkv and gate/up, RMSNorm, rotary, paged-KV
attention) run under the communication schedule that the config's `dtp` entry records.

Each rank keeps its own residual stream X_l (vLLM's layout, [T, D]: the batch's tokens flattened). o_proj
and down_proj do not all-reduce (reduce_results=False), nor does an MoE block's FusedMoE (its final all-reduce
skipped, `keep_partial`; the replicated router runs on this rank's own normed stream: each rank routes its own
tokens), so module n yields this rank's partial o_n^l. As
in the project's runtime (`models.runtime.rank.RankModel.forward`, read off the same `ArrivalPlan`): after
module n the rank sends the exchange that n completes (the all-reduce of the sum of the partials arriving
together), and before module n+1 its own partials due there (scaled by s_m) and the others' share of the
exchange due there (total − own; the total where every partial in it arrives whole) enter its stream.
How an exchange runs is the plugin's `exchange` setting (models/serving/vllm/options.py): `eager` reduces
at once with vLLM's own all-reduce and keeps the others' share until it is due; `overlap` starts an
asynchronous all-reduce on the TP group's device group and waits only where it is due. Both give the same
numbers. `link_latency_us` makes each result usable that long after its collective completed.

What each module does is read off the plan once, in __init__ (`ModuleStep`); the additions due before a
norm enter the stream through vLLM's fused residual RMSNorm (`norm(addend, x)`), as in vLLM's own Llama.
Where every exchange arrives whole (tp, pt:D) the ranks' streams are equal and the final norm's output is
used as it is; otherwise every rank applies the final norm to its stream and the streams are averaged by
one all-reduce, so the hidden state reaching vLLM's vocab-parallel LM head is the same on every rank (the
runtime sums onto rank 0 and divides by L: the same numbers).

CUDA graphs: `eager` uses vLLM's own all-reduce alone, which its graphs capture; on CUDA, `overlap` runs each
delayed exchange as the custom ops of models.serving.exchange_ops (the all-reduce on a side stream forked
after an event and joined where it is due), which a graph captures too, so vLLM need not run the model with
enforce_eager. The emulated link latency sleeps on the host, which no graph can capture: on a GPU it needs
enforce_eager (checked at construction). The model is not compiled by torch.compile (no
`support_torch_compile`); vLLM's full CUDA graphs wrap it whole. Not yet run on a GPU (docs/serving.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    tensor_model_parallel_all_reduce,
)
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel
from vllm.model_executor.models.mistral import MistralDecoderLayer
from vllm.model_executor.models.mixtral import MixtralDecoderLayer, MixtralModel
from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer, Qwen2Model
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
from vllm.model_executor.models.qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeModel
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from models.export.serving_manifest import ServingError, check_entry
from models.runtime.arrivals import ArrivalPlan
from models.serving import exchange_ops  # registers torch.ops.dtp_layout.* in every vLLM process
from models.serving.vllm.options import PluginSettings, check_exchange, check_link_latency, resolve_settings
from models.serving.vllm.weights import check_devices, load_rank_shard, shards_manifest

__all__ = ["DtpForCausalLM", "DtpLlamaForCausalLM", "DtpMistralForCausalLM", "DtpMixtralForCausalLM", "DtpModel",
           "DtpQwen2ForCausalLM", "DtpQwen3ForCausalLM", "DtpQwen3MoeForCausalLM", "ModuleStep", "keep_partial",
           "module_steps"]

LayerFactory = Callable[[VllmConfig, str], nn.Module]
logger = init_logger("vllm.dtp_layout")  # under vLLM's logger: printed with its own lines


def _check_config(vllm_config: VllmConfig) -> None:
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ServingError("DTP models run on tensor parallelism alone: pipeline_parallel_size must be 1, got "
                           f"{parallel.pipeline_parallel_size}")


def _check_graphs(settings: PluginSettings, *, cuda: bool, enforce_eager: bool) -> None:
    """The emulated latency sleeps on the host: a CUDA graph would replay without it."""
    if cuda and settings.link_latency_us > 0 and not enforce_eager:
        raise ServingError("link_latency_us sleeps on the host, which CUDA graphs cannot capture: serve with "
                           "--enforce-eager (enforce_eager=True) or a link latency of 0")


def _platform() -> str:
    return "cuda" if current_platform.is_cuda_alike() else str(current_platform.device_type)


@dataclass(frozen=True)
class ModuleStep:
    """What a rank does around module n, read off the ArrivalPlan once."""

    n: int
    hold: bool  # its own partial enters the stream alone later (kept until then)
    joins: int | None  # the arrival point of the exchange its partial is summed into (None: never sent)
    first: bool  # ... and it is the first module of that exchange's sum
    sends: int | None  # the arrival point whose exchange is sent right after it
    whole: bool  # that exchange enters the stream as the sum over ranks (no own share to take out)
    own: tuple[tuple[int, float], ...]  # (m, s_m): own partials entering before module n+1
    exchange: bool  # the exchange due before module n+1 enters there
    fuse: bool  # what enters before module n+1 is a fresh tensor the fused norm may overwrite


def module_steps(plan: ArrivalPlan) -> tuple[ModuleStep, ...]:
    held = {m for arrival in plan.arrivals for m, _ in arrival.own}
    steps = []
    for n in range(plan.num_modules):
        due, sends, arrival = plan.others_due[n], plan.sends[n], plan.arrivals[n]
        first = due is not None and min(plan.members[due]) == n
        whole = sends is not None and plan.arrivals[sends - 1].whole
        # a lone unscaled own partial may still be summed into an exchange or wanted for its own share
        lone_raw = not arrival.exchange and len(arrival.own) == 1 and arrival.own[0][1] == 1.0
        steps.append(ModuleStep(n, n in held, due, first, sends, whole, arrival.own, arrival.exchange, not lone_raw))
    return tuple(steps)


@dataclass
class Flight:
    """A sent exchange: eager holds the others' share already; overlap the work, its buffer and own sum."""

    value: torch.Tensor  # eager: what enters the stream; overlap: the buffer being reduced (CUDA: the sum's home)
    own: torch.Tensor | None  # overlap, not whole: the own sum to take out of the total
    work: Any  # overlap on the CPU: the async work; None once reduced
    handle: torch.Tensor | None  # overlap on CUDA: exchange_ops' handle
    completed: list[float]  # when the collective completed (perf_counter), for the emulated latency


class Exchanger:
    """Runs a schedule's exchanges in one mode, with the emulated link latency."""

    def __init__(self, settings: PluginSettings, group: Any, cuda: bool) -> None:
        self.overlap = settings.exchange == "overlap" and group is not None
        self.latency_s = settings.link_latency_us * 1e-6
        self.group, self.cuda = group, cuda
        self.group_name = group.group_name if group is not None else ""

    def send(self, own: torch.Tensor, *, whole: bool, waited_now: bool, keep: bool) -> Flight:
        """Start the all-reduce of `own` (`keep`: `own` is used again, reduce a copy)."""
        if self.overlap and not waited_now and self.cuda:  # capturable: side stream, fork and join events
            out = torch.empty_like(own)  # [T, D]: allocated here, before the start, where a graph keeps it
            return Flight(out, own=None if whole else own, work=None, handle=exchange_ops.start(own, self.group_name),
                          completed=[])
        if self.overlap and not waited_now:
            total = own.clone()  # [T, D]
            work = dist.all_reduce(total, group=self.group, async_op=True)
            completed: list[float] = []
            if self.latency_s > 0 and not self.cuda:  # gloo runs the future's callbacks at completion
                work.get_future().add_done_callback(lambda _: completed.append(time.perf_counter()))
            return Flight(total, own=None if whole else own, work=work, handle=None, completed=completed)
        total = tensor_model_parallel_all_reduce(own.clone() if keep or not whole else own)  # in place on CPU
        value = total if whole else total.sub_(own)  # the others' share; `total` is a copy or vLLM's output
        return Flight(value, own=None, work=None, handle=None,
                      completed=[time.perf_counter()] if self.latency_s else [])

    def receive(self, flight: Flight) -> torch.Tensor:
        """What the exchange adds to the stream, once it is usable."""
        if flight.handle is not None:
            exchange_ops.wait_into(flight.handle, flight.value)
        elif flight.work is not None:
            flight.work.wait()
        self._await_link(flight.completed)
        return flight.value if flight.own is None else flight.value.sub_(flight.own)  # the buffer is ours

    def average(self, h: torch.Tensor, devices: int) -> torch.Tensor:
        """Σ_l h_l / L, usable `latency` after the all-reduce (the final norm's exchange)."""
        total = tensor_model_parallel_all_reduce(h)
        self._await_link([time.perf_counter()])
        return total / devices

    def _await_link(self, completed: list[float]) -> None:
        if self.latency_s > 0:  # a result waited for before it is usable blocks for the rest
            remaining = (completed[0] if completed else time.perf_counter()) + self.latency_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)


def keep_partial(ffn: Any) -> None:
    """The FFN returns this rank's partial: a dense FFN's down_proj skips its all-reduce; an MoE block's experts
    (vLLM's FusedMoE, its router run on this rank's own input) skip their final all-reduce, as vLLM's own models
    that fuse that reduction into the next norm do (`moe_config.skip_final_all_reduce`)."""
    if hasattr(ffn, "down_proj"):
        ffn.down_proj.reduce_results = False
        return
    moe_config = ffn.experts.moe_config
    moe_config.skip_final_all_reduce = True
    if moe_config.is_sequence_parallel or moe_config.moe_parallel_config.use_all2all_kernels:
        raise ServingError("the DTP MoE keeps each rank's partial of every expert (tensor parallelism); sequence-"
                           "parallel or all-to-all (expert-parallel) MoE cannot defer its reduction: serve without "
                           "--enable-expert-parallel")


class DtpModel(nn.Module):
    """Embeddings, the family's decoder layers and the final norm, run under the schedule. Parameter names
    are those of vLLM's own model (model.embed_tokens, model.layers.N..., model.norm), so the permuted HF
    checkpoint loads through vLLM's usual mapping."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str, make_layer: LayerFactory,
                 mapper: WeightsMapper, ffn_name: str = "mlp") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.mapper = mapper
        self.ffn_name = ffn_name
        self.devices = get_tensor_model_parallel_world_size()
        entry = getattr(config, "dtp", None)
        self._set_schedule(entry)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList([make_layer(vllm_config, f"{prefix}.layers.{i}")
                                     for i in range(config.num_hidden_layers)])
        layer: Any
        for layer in self.layers:  # each rank keeps its partial: the schedule decides when the others arrive
            layer.self_attn.o_proj.reduce_results = False
            keep_partial(getattr(layer, ffn_name))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # module n's norm and body, as plain callables (no per-step lookups)
        self._norms: list[Any] = [n for layer in self.layers for n in (layer.input_layernorm,
                                                                         layer.post_attention_layernorm)]
        self._bodies: list[Any] = [b for layer in self.layers for b in (layer.self_attn, getattr(layer, ffn_name))]
        try:
            settings = resolve_settings(entry, os.environ, _platform())
        except ValueError as exc:
            raise ServingError(str(exc)) from exc
        self.enforce_eager = vllm_config.model_config.enforce_eager
        self.configure(settings)
        if get_tensor_model_parallel_rank() == 0:
            logger.info("DTP schedule %s on TP=%d: %s", self.schedule.name, self.devices, settings.describe())

    def reschedule(self, entry: Any) -> None:
        """Run under the schedule this `dtp` entry records (checked as the config's is at load) from the next
        forward on. No weight depends on the schedule (export writes the same rank shards for every one), so
        the engine host serves one load under several; KV cached under the old schedule is not this one's:
        the caller drops it (vLLM's LLM.reset_prefix_cache)."""
        self._set_schedule(entry)
        if get_tensor_model_parallel_rank() == 0:
            logger.info("DTP schedule %s on TP=%d: %s (switched in place)", self.schedule.name, self.devices,
                        self.settings.describe())

    def _set_schedule(self, entry: Any) -> None:
        self.schedule = check_entry(entry, num_layers=self.config.num_hidden_layers, tp_size=self.devices)
        self.plan = ArrivalPlan.of(self.schedule)
        self.steps = module_steps(self.plan)
        # every exchange whole, no own partial alone: the ranks' streams stay equal (tp, pt:D)
        self.equal_streams = all(not a.own for a in self.plan.arrivals) and None not in self.plan.others_due

    def configure(self, settings: PluginSettings) -> None:
        """Run the exchanges as `settings` says from the next forward on (the bench switches it in place)."""
        check_exchange(settings.exchange, "exchange")
        check_link_latency(settings.link_latency_us, "link_latency_us")
        cuda = current_platform.is_cuda_alike()
        _check_graphs(settings, cuda=cuda, enforce_eager=self.enforce_eager)
        self.settings = settings
        group = None if self.devices == 1 else get_tp_group().device_group
        self.exchanger = Exchanger(settings, group, cuda)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # [T, D], the same on every rank

    def _body(self, n: int, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """This rank's partial output of module n from its normed stream h: [T, D] -> [T, D]."""
        out: torch.Tensor = self._bodies[n](positions=positions, hidden_states=h) if n % 2 == 0 else \
            self._bodies[n](h)
        return out

    @staticmethod
    def _enter(norm: Any, x: torch.Tensor, addends: list[torch.Tensor], fuse: bool) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
        """(norm(x'), x') with x' = x + the addends: [T, D] each; one fused add-and-norm where it may."""
        if not addends:
            return norm(x), x
        addend = addends[0]
        for more in addends[1:]:
            addend = addend + more  # a new tensor: the addends themselves stay as they are
        if not fuse:  # the lone addend is still wanted elsewhere: the fused norm would overwrite it
            x = x + addend
            return norm(x), x
        h, x = norm(addend, x)
        return h, x

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is not None:
            x = inputs_embeds.clone()  # [T, D]: the fused norm updates the stream in place
        else:
            assert input_ids is not None
            x = self.embed_input_ids(input_ids)  # [T, D]
        exchanger = self.exchanger
        addends: list[torch.Tensor] = []  # what enters the stream before the next norm
        fuse = True
        held: dict[int, torch.Tensor] = {}  # own partials not yet in x, [T, D]
        sums: dict[int, torch.Tensor] = {}  # arrival point -> the sum of its exchange's own partials so far
        flights: dict[int, Flight] = {}  # arrival point -> the exchange sent for it
        for step in self.steps:
            h, x = self._enter(self._norms[step.n], x, addends, fuse)
            partial = self._body(step.n, positions, h)  # [T, D]
            if step.hold:
                held[step.n] = partial
            if step.joins is not None:
                own = partial if step.first else sums.pop(step.joins) + partial
                if step.sends is None:
                    sums[step.joins] = own
                else:
                    flights[step.sends] = exchanger.send(own, whole=step.whole, waited_now=step.sends == step.n + 1,
                                                         keep=step.hold and own is partial)
            addends = [held.pop(m) * s if s != 1.0 else held.pop(m) for m, s in step.own]
            if step.exchange:
                addends.append(exchanger.receive(flights.pop(step.n + 1)))
            fuse = step.fuse
        h, x = self._enter(self.norm, x, addends, fuse)  # [T, D]: this rank's normed stream
        if self.devices == 1 or self.equal_streams:
            return h
        return exchanger.average(h, self.devices)  # Σ_l final_norm(X_l) / L, the same on every rank

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.mapper)


class DtpForCausalLM(nn.Module):
    """The causal LM around `DtpModel`: vLLM's vocab-parallel LM head and logits processor."""

    mapper: WeightsMapper = LlamaModel.hf_to_vllm_mapper
    ffn_name: ClassVar[str] = "mlp"  # the decoder layer's FFN module (vLLM's Mixtral: block_sparse_moe)
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                                              "gate_up_proj": ["gate_proj", "up_proj"]}

    @staticmethod
    def make_layer(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        raise NotImplementedError

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        _check_config(vllm_config)
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model_path = vllm_config.model_config.model
        self.manifest = shards_manifest(self.model_path)  # None: a permuted HF checkpoint
        if self.manifest is not None:
            check_devices(self.manifest, self.model_path, get_tensor_model_parallel_world_size())
        self.model = DtpModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                              make_layer=type(self).make_layer, mapper=self.mapper, ffn_name=self.ffn_name)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, scale=getattr(config, "logit_scale", 1.0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits: torch.Tensor | None = self.logits_processor(self.lm_head, hidden_states)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.manifest is not None:  # shards/: this rank's file alone (the iterator is never read)
            return load_rank_shard(self, self.model_path, self.manifest, get_tensor_model_parallel_rank())
        return AutoWeightsLoader(self).load_weights(weights)  # it handles a tied LM head itself


def _layer_of_hf_config(layer_class: Any, vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """vLLM's Qwen2 and Qwen3 decoder layers take the HF config and the cache and quantisation configs, where
    Llama's and Mistral's take the whole VllmConfig."""
    layer: nn.Module = layer_class(config=vllm_config.model_config.hf_config, cache_config=vllm_config.cache_config,
                                   quant_config=vllm_config.quant_config, prefix=prefix)
    return layer


class DtpLlamaForCausalLM(DtpForCausalLM):
    @staticmethod
    def make_layer(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return LlamaDecoderLayer(vllm_config=vllm_config, prefix=prefix)


class DtpMistralForCausalLM(DtpForCausalLM):
    @staticmethod
    def make_layer(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return MistralDecoderLayer(vllm_config=vllm_config, prefix=prefix)


class DtpQwen2ForCausalLM(DtpForCausalLM):
    mapper = Qwen2Model.hf_to_vllm_mapper

    @staticmethod
    def make_layer(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return _layer_of_hf_config(Qwen2DecoderLayer, vllm_config, prefix)


class DtpQwen3ForCausalLM(DtpForCausalLM):
    mapper = Qwen2Model.hf_to_vllm_mapper

    @staticmethod
    def make_layer(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return _layer_of_hf_config(Qwen3DecoderLayer, vllm_config, prefix)


class DtpQwen3MoeForCausalLM(DtpForCausalLM):
    """Qwen3-MoE: vLLM's Qwen3-MoE decoder layer (FusedMoE experts, 1/L of every expert's neurons per rank)."""

    mapper = Qwen3MoeModel.hf_to_vllm_mapper
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    @staticmethod
    def make_layer(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return Qwen3MoeDecoderLayer(vllm_config=vllm_config, prefix=prefix)


class DtpMixtralForCausalLM(DtpForCausalLM):
    """Mixtral: vLLM's Mixtral decoder layer, whose MoE block is `block_sparse_moe` as in the checkpoint."""

    mapper = MixtralModel.hf_to_vllm_mapper
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    ffn_name = "block_sparse_moe"

    @staticmethod
    def make_layer(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return _layer_of_hf_config(MixtralDecoderLayer, vllm_config, prefix)
