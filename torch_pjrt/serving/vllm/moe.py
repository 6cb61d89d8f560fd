"""Mixture-of-experts layers on pjrt: vLLM's unquantized fused-MoE method with routing and experts in torch ops.

On an out-of-tree platform vLLM's `UnquantizedFusedMoEMethod` selects no experts kernel (its OOT backend is
left for the platform to supply), its default router calls `_moe_C.topk_softmax`, a CUDA kernel the CPU build
lacks, and its CPU experts are C++ kernels on host memory. `PjrtFusedMoEMethod` takes vLLM's place for that
method (vLLM's out-of-tree custom-op registry) and is monolithic: it routes and runs the experts itself, on
the device, in torch ops that every eager mode and the compile path lower.

The experts run densely: every token through every expert, the outputs weighted by the routing (zero for
the experts a token did not pick). Shapes are static, so XLA compiles one program per token bucket, at
`experts / top_k` times the arithmetic of a sparse kernel; fine for small expert counts, the price of having
no grouped-GEMM kernel yet.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

GATED_ACTIVATIONS = {
    MoEActivation.SILU: F.silu,
    MoEActivation.GELU: F.gelu,
    MoEActivation.GELU_TANH: lambda x: F.gelu(x, approximate="tanh"),
}


class PjrtFusedMoEMethod(UnquantizedFusedMoEMethod):
    """Top-k softmax or sigmoid routing and dense gated experts in torch ops; refuses routing it would not
    honour (grouped top-k, custom routing functions, score-correction biases, expert parallelism)."""

    @property
    def is_monolithic(self) -> bool:
        return True  # routing is done here: vLLM's routers call CUDA kernels

    def apply_monolithic(
        self, layer: Any, x: torch.Tensor, router_logits: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        _check_supported(layer)
        scores = router_logits.float()
        scores = scores.softmax(-1) if layer.scoring_func == "softmax" else scores.sigmoid()
        weights, experts = scores.topk(layer.top_k, dim=-1)
        if layer.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if layer.routed_scaling_factor != 1.0:
            weights = weights * layer.routed_scaling_factor
        # (tokens, experts): a token's routing weight for each expert, zero for those it did not pick
        combine = torch.zeros_like(scores).scatter(-1, experts, weights).to(x.dtype)
        gate_up = torch.einsum("th,eoh->teo", x, layer.w13_weight)
        if getattr(layer, "w13_bias", None) is not None:
            gate_up = gate_up + layer.w13_bias
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = GATED_ACTIVATIONS[layer.activation](gate) * up
        out = torch.einsum("tei,ehi->teh", hidden, layer.w2_weight)
        if getattr(layer, "w2_bias", None) is not None:
            out = out + layer.w2_bias
        return torch.einsum("te,teh->th", combine, out)


def _check_supported(layer: Any) -> None:
    unsupported = {
        "grouped top-k routing": layer.use_grouped_topk,
        "a custom routing function": layer.custom_routing_function is not None,
        "a score-correction bias": layer.e_score_correction_bias is not None,
        "expert parallelism (an expert map)": layer.expert_map is not None,
        "router weights applied to the input": layer.apply_router_weight_on_input,
        "a routing sink": layer.routing_sink is not None,
        f"scoring function {layer.scoring_func!r}": layer.scoring_func not in ("softmax", "sigmoid"),
        f"activation {layer.activation.value!r}": layer.activation not in GATED_ACTIVATIONS,
    }
    refused = [what for what, present in unsupported.items() if present]
    if refused:
        raise NotImplementedError(f"the pjrt mixture-of-experts layer does not support {', '.join(refused)} yet")


def register_fused_moe_method() -> None:
    """Makes vLLM build PjrtFusedMoEMethod wherever it builds UnquantizedFusedMoEMethod (once per process)."""
    name = UnquantizedFusedMoEMethod.__name__  # the name vLLM's CustomOp.__new__ looks up
    if op_registry_oot.get(name) is not PjrtFusedMoEMethod:
        CustomOp.register_oot(PjrtFusedMoEMethod, name=name)
