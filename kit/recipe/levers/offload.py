"""training.offload_activations: what autograd keeps for backward waits in host memory (rank side).

    with offload.activations(enabled, device):   # around the forward; backward brings them back
        loss = model(**batch).loss
    loss.backward()

Every tensor autograd saves during the forward passes through a pack hook (torch's saved-tensor
hooks); this one copies each large one (a GPU tensor of at least `min_bytes` that is not a
parameter) into pinned host memory on a side stream, so the copy overlaps the forward's compute,
and frees the GPU copy once it is done. In backward the unpack hook hands back its GPU copy and
starts copying the one saved before it (backward's next, in reverse order) on the side stream,
so that copy overlaps this one's backward; the first is copied on the compute stream. What gets
offloaded depends on training.recompute: with whole-layer recompute (keeps=inputs) it is each
decoder layer's input, the one tensor such a layer keeps (the checkpoint saves it through
autograd; measured here: the layer inputs are what an outer hook sees); with recompute off it is
everything the layers keep; the matmul results a selective policy (keeps=matmuls, ...) keeps are
stored by the checkpoint itself and stay on the GPU. Compiled
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
    held = list(model.buffers())
    for module in model.modules():
        for state in (getattr(module, "quant_state", None),
                      getattr(getattr(module, "weight", None), "quant_state", None)):
            for part in (state, getattr(state, "state2", None)):
                fields = getattr(part, "__dict__", {})
                held += [v for v in fields.values() if isinstance(v, torch.Tensor)]
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
        self.order: list[_Moved | None] = []  # what was moved, in the forward's order

    def _activation(self, tensor: torch.Tensor) -> bool:
        return (tensor.device.type == self.device.type
                and tensor.numel() * tensor.element_size() >= self.min_bytes
                and not isinstance(tensor, torch.nn.Parameter)
                and tensor.untyped_storage().data_ptr() not in self.held)

    def pack(self, tensor: torch.Tensor):
        chosen = self._activation(tensor)
        if chosen:
            self.chosen.append(tuple(tensor.shape))
        if self.stream is None or not chosen:  # on a CPU: nothing to move to
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
        moved = _Moved(host, done, len(self.order))
        self.order.append(moved)
        return moved

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        compute = torch.cuda.current_stream(self.device)
        if packed.fetched is None:  # not prefetched: copied back on the compute stream
            compute.wait_event(packed.done)
            tensor = packed.host.to(self.device, non_blocking=True)
        else:
            compute.wait_event(packed.fetched_done)
            tensor, packed.fetched = packed.fetched, None
        self.order[packed.index] = None  # used: the step keeps no GPU copy of it past its use
        # Backward uses what forward saved in reverse: the one saved before this one comes next
        # (a whole-layer recompute's inputs: the layer below's). Its copy back runs on the side
        # stream while this layer's backward computes.
        before = next((m for m in reversed(self.order[:packed.index]) if m is not None), None)
        if before is not None and before.fetched is None:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(before.done)
                before.fetched = before.host.to(self.device, non_blocking=True)
                before.fetched_done = torch.cuda.Event()
                before.fetched_done.record(self.stream)
            before.fetched.record_stream(compute)  # allocated on the side stream, used on this one
        return tensor


class _Moved:
    """A saved tensor in host memory: its copy-out's event, its place in the forward's order,
    and its GPU copy once prefetched."""

    __slots__ = ("host", "done", "index", "fetched", "fetched_done")

    def __init__(self, host: torch.Tensor, done, index: int):
        self.host, self.done, self.index = host, done, index
        self.fetched = self.fetched_done = None


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
