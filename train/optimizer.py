"""The draft's optimizer: AdamW whose updates keep fp32 precision in either parameter dtype.

    train.param_dtype=float32    torch's fused AdamW over fp32 weights (autocast runs the matmuls
                                 in bf16 on a cast copy): 16 bytes per trainable parameter
    train.param_dtype=bfloat16   MasterAdamW: bf16 weights, the matmuls' own operands, with bf16
                                 gradients accumulated by the GEMMs (train/weight_grads.py), an
                                 int16 remainder per weight that makes it an exact fp32 master,
                                 and fp32 moments (kernels/master_adamw.py): 14 bytes

Both take the same steps up to the rounding of the bf16 gradients. AdamW over bf16 weights and
bf16 moments (8 bytes) is not offered: its updates below ~2^-8 of a weight are rounded away, so
norm gains never leave 1.0 and at small learning rates most weights never move.

`optimizer.found_inf` (a 0-dim device flag set by the trainer before `step()`) skips a step on the
device, weights, moments and step count unchanged, as torch's fused AdamW does with the same
attribute: no host sync.
"""

from __future__ import annotations

import torch

from eagleforge.kernels.master_adamw import master_adamw_step_


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (FSDP2), or the tensor itself; in-place ops reach the parameter."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class MasterAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's formula) over bf16 parameters with exact fp32
    masters. State per parameter, shaped and sharded like it: `master_remainder` int16,
    `exp_avg` and `exp_avg_sq` fp32, `step` fp32 0-dim."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.found_inf: torch.Tensor | None = None
        # torch's load_state_dict casts every state tensor but `step` to its parameter's dtype (bf16
        # here): the int16 remainders and fp32 moments are put back as they were saved.
        self._saved_state: dict = {}
        self.register_load_state_dict_pre_hook(MasterAdamW._keep_saved_state)
        self.register_load_state_dict_post_hook(MasterAdamW._restore_saved_state)

    @staticmethod
    def _keep_saved_state(optimizer: "MasterAdamW", state_dict: dict) -> None:
        optimizer._saved_state = {"state": dict(state_dict["state"]), "groups": [g["params"] for g in state_dict["param_groups"]]}

    @staticmethod
    def _restore_saved_state(optimizer: "MasterAdamW") -> None:
        saved, optimizer._saved_state = optimizer._saved_state, {}
        ids = [i for group in saved["groups"] for i in group]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, param in zip(ids, params):  # as torch maps them: saved ids to parameters in order
            for key, value in saved["state"].get(index, {}).items():
                if key != "step" and isinstance(value, torch.Tensor):
                    optimizer.state[param][key] = value.to(device=optimizer.state[param][key].device)

    @staticmethod
    def _init_state(param: torch.Tensor, state: dict) -> None:
        if param.dtype != torch.bfloat16:
            raise ValueError(f"MasterAdamW steps bfloat16 parameters; got one of {param.dtype} {tuple(param.shape)}")
        state["step"] = torch.zeros((), dtype=torch.float32, device=_local(param).device)
        state["master_remainder"] = torch.zeros_like(param, dtype=torch.int16)  # the master starts at the bf16 weight
        state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    self._init_state(param, state)
                skip = None if self.found_inf is None else self.found_inf.to(state["step"].device)
                master_adamw_step_(_local(param), _local(state["master_remainder"]), _local(param.grad), _local(state["exp_avg"]),
                                   _local(state["exp_avg_sq"]), state["step"], skip, lr=group["lr"], beta1=beta1, beta2=beta2,
                                   eps=group["eps"], weight_decay=group["weight_decay"])


def build_optimizer(params: list[torch.Tensor], param_dtype: torch.dtype, lr: float, betas: tuple[float, float],
                    weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer for `params` (all of `param_dtype`): MasterAdamW for bf16, torch's fused AdamW for fp32."""
    if param_dtype == torch.bfloat16:
        return MasterAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
