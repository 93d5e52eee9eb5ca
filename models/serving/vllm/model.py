"""DTP models for vLLM: the family's own vLLM decoder layers (fused qkv and gate/up, RMSNorm, rotary, paged-KV
attention) run under the communication schedule that the config's `dtp` entry records.

Each rank keeps its own residual stream X_l (vLLM's layout, [T, D]: the batch's tokens flattened). o_proj
and down_proj do not all-reduce (reduce_results=False), so module n yields this rank's partial o_n^l. As
in the project's runtime (`models.runtime.rank.RankModel.forward`, read off the same `ArrivalPlan`): after
module n the rank starts the exchange that n completes (an async all-reduce of the sum of the partials
arriving together, on the TP group's device group), adds its own partials due before module n+1 (scaled
by s_m) and waits for the exchange due there only then, adding the others' share (total − own). An
exchange waited right after it starts (every module of tp, the block ends of pt:D, the final average) goes
through vLLM's own all-reduce instead (its shared-memory all-reduce on CPU, custom all-reduce or NCCL on
GPU): nothing could overlap it, and vLLM's is much faster than a gloo all-reduce on CPU. At the
end every rank applies the final norm to its stream and the streams are averaged by one all-reduce, so
the hidden state reaching vLLM's vocab-parallel LM head is the same on every rank (the runtime sums onto
rank 0 and divides by L: the same numbers).

Python async handles cannot be captured by CUDA graphs or torch.compile: the model is not compiled, and
on a GPU vLLM must run it with enforce_eager (checked at construction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel
from vllm.model_executor.models.mistral import MistralDecoderLayer
from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer, Qwen2Model
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from models.runtime.arrivals import ArrivalPlan
from models.serving.manifest import ServingError, check_entry
from models.serving.vllm.weights import check_devices, load_rank_shard, shards_manifest

__all__ = ["DtpForCausalLM", "DtpLlamaForCausalLM", "DtpMistralForCausalLM", "DtpModel", "DtpQwen2ForCausalLM",
           "DtpQwen3ForCausalLM"]

LayerFactory = Callable[[VllmConfig, str], nn.Module]


def _check_config(vllm_config: VllmConfig) -> None:
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ServingError("DTP models run on tensor parallelism alone: pipeline_parallel_size must be 1, got "
                           f"{parallel.pipeline_parallel_size}")
    if current_platform.is_cuda_alike() and not vllm_config.model_config.enforce_eager:
        raise ServingError("the DTP model waits on asynchronous all-reduces that CUDA graphs cannot capture: "
                           "serve it with --enforce-eager (enforce_eager=True)")


class DtpModel(nn.Module):
    """Embeddings, the family's decoder layers and the final norm, run under the schedule. Parameter names
    are those of vLLM's own model (model.embed_tokens, model.layers.N..., model.norm), so the permuted HF
    checkpoint loads through vLLM's usual mapping."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str, make_layer: LayerFactory,
                 mapper: WeightsMapper) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.mapper = mapper
        self.devices = get_tensor_model_parallel_world_size()
        self.schedule = check_entry(getattr(config, "dtp", None), num_layers=config.num_hidden_layers,
                                    tp_size=self.devices)
        self.plan = ArrivalPlan.of(self.schedule)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList([make_layer(vllm_config, f"{prefix}.layers.{i}")
                                     for i in range(config.num_hidden_layers)])
        layer: Any
        for layer in self.layers:  # each rank keeps its partial: the schedule decides when the others arrive
            layer.self_attn.o_proj.reduce_results = False
            layer.mlp.down_proj.reduce_results = False
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # [T, D], the same on every rank

    def _partial(self, n: int, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output of module n from its stream x: [T, D] -> [T, D]."""
        layer: Any = self.layers[n // 2]
        if n % 2 == 0:
            out: torch.Tensor = layer.self_attn(positions=positions, hidden_states=layer.input_layernorm(x))
        else:
            out = layer.mlp(layer.post_attention_layernorm(x))
        return out

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is not None:
            x = inputs_embeds  # [T, D]
        else:
            assert input_ids is not None
            x = self.embed_input_ids(input_ids)  # [T, D]
        group = None if self.devices == 1 else get_tp_group().device_group
        plan = self.plan
        held: dict[int, torch.Tensor] = {}  # own partials not yet in x, [T, D]
        sums: dict[int, torch.Tensor] = {}  # arrival point -> the sum of its exchange's own partials so far
        inflight: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}  # arrival -> (work, total, own)
        for n in range(plan.num_modules):
            partial = self._partial(n, positions, x)  # [T, D]
            held[n] = partial
            due = plan.others_due[n]
            if due is not None:
                sums[due] = partial if due not in sums else sums[due] + partial
                if plan.sends[n] == due:  # the last module of that exchange: start it, wait before module `due`
                    own = sums.pop(due)
                    if group is None:
                        inflight[due] = (None, own, own)
                    elif due == n + 1:  # waited right away: vLLM's own all-reduce (shm on CPU, custom/NCCL on GPU)
                        inflight[due] = (None, tensor_model_parallel_all_reduce(own.clone()), own)
                    else:  # waited modules later: an asynchronous all-reduce on the TP group's device group
                        total = own.clone()  # [T, D]
                        inflight[due] = (dist.all_reduce(total, group=group, async_op=True), total, own)
            arrival = plan.arrivals[n]  # before module n+1
            for m, scale in arrival.own:
                mine = held.pop(m)
                x = x + (mine * scale if scale != 1.0 else mine)
            if arrival.exchange:
                work, total, own = inflight.pop(n + 1)
                if work is not None:
                    work.wait()
                x = x + (total if arrival.whole else total - own)  # Σ_j o^j, or the others' share alone
            for m in plan.own_done[n]:
                held.pop(m, None)
        h = self.norm(x)  # [T, D]: this rank's normed stream
        if group is None:
            return h
        return tensor_model_parallel_all_reduce(h) / self.devices  # Σ_l final_norm(X_l) / L, the same on every rank

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.mapper)


class DtpForCausalLM(nn.Module):
    """The causal LM around `DtpModel`: vLLM's vocab-parallel LM head and logits processor."""

    mapper: WeightsMapper = LlamaModel.hf_to_vllm_mapper
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
                              make_layer=type(self).make_layer, mapper=self.mapper)
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
