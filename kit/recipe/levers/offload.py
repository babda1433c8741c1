"""training.offload_activations: what autograd keeps for backward waits in host memory (rank side).

    with offload.activations(enabled, device):   # around the forward; backward brings them back
        loss = model(**batch).loss
    loss.backward()

Every tensor autograd saves during the forward passes through a pack hook (torch's saved-tensor
hooks); this one copies each large one (a GPU tensor of at least `min_bytes` that is not a
parameter) into pinned host memory on a side stream, so the copy overlaps the forward's compute,
and frees the GPU copy once it is done. In backward the unpack hook copies it back on the compute
stream just before it is used. What gets offloaded depends on training.recompute: with whole-layer
recompute (keeps=inputs) it is each decoder layer's input, the one tensor such a layer keeps (the
checkpoint saves it through autograd; measured here: the layer inputs are what an outer hook
sees); with recompute off it is everything the layers keep; the matmul results a selective policy
(keeps=matmuls, ...) keeps are stored by the checkpoint itself and stay on the GPU. Compiled
layers (training.compile) under whole-layer recompute hand the hook the same layer inputs, and
besides them the model's own constants their graphs read (the 4-bit layers' quantization state,
rotary tables): `persistent(model)` names those, which stay where they are (moving a tensor the
model holds frees nothing).

Gap filled: torch's `save_on_cpu` copies on the compute stream (the forward waits for each copy);
TRL's and torchtune's activation offloading are designs of the same kind, not a library this
recipe's loop can call. On a CPU there is nothing to move: the hooks only count.
"""

from __future__ import annotations

import contextlib

import torch


def persistent(model) -> frozenset[int]:
    """The storages of what the model holds apart from its parameters (which the hooks know by
    type): its buffers and its 4-bit layers' quantization state (bitsandbytes' QuantState and
    its nested state: absmax, code, offset)."""
    held = [b for b in model.buffers()]
    for module in model.modules():
        for state in (getattr(module, "quant_state", None),
                      getattr(getattr(module, "weight", None), "quant_state", None)):
            for part in (state, getattr(state, "state2", None)):
                held += [v for v in vars(part).values() if isinstance(v, torch.Tensor)] \
                    if part is not None and hasattr(part, "__dict__") else []  # fmt: skip
    return frozenset(t.untyped_storage().data_ptr() for t in held)


class Offloader:
    """Pack and unpack hooks; `moved`/`kept` count the tensors and `moved_bytes` their bytes;
    `chosen` the shapes of those it moves (on a CPU: would move)."""

    def __init__(self, device: torch.device, min_bytes: int = 1 << 20,
                 held: frozenset[int] = frozenset()):
        self.device, self.min_bytes, self.held = device, min_bytes, held
        self.moved = self.kept = self.moved_bytes = 0
        self.chosen: list[tuple[int, ...]] = []
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.in_flight: list = []  # (GPU tensor, event): kept alive until its copy is done

    def _activation(self, tensor: torch.Tensor) -> bool:
        return (tensor.numel() * tensor.element_size() >= self.min_bytes
                and not isinstance(tensor, torch.nn.Parameter)
                and tensor.untyped_storage().data_ptr() not in self.held)

    def pack(self, tensor: torch.Tensor):
        if self._activation(tensor):
            self.chosen.append(tuple(tensor.shape))
        if self.stream is None or not tensor.is_cuda or not self._activation(tensor):
            self.kept += 1
            return tensor
        self.in_flight = [(t, e) for t, e in self.in_flight if not e.query()]
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.in_flight.append((tensor, done))  # the GPU copy lives until the host copy is done
        self.moved += 1
        self.moved_bytes += host.numel() * host.element_size()
        return (host, done)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, done = packed
        torch.cuda.current_stream(self.device).wait_event(done)
        return host.to(self.device, non_blocking=True)


@contextlib.contextmanager
def activations(enabled: bool, device: torch.device, min_bytes: int = 1 << 20,
                held: frozenset[int] = frozenset()):
    """Offload what the forward inside saves for backward (see the module), except the storages
    in `held` (`persistent(model)`); yields the Offloader (None when not enabled)."""
    if not enabled:
        yield None
        return
    offloader = Offloader(device, min_bytes, held)
    with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
        yield offloader
