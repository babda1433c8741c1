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
(keeps=matmuls, ...) keeps are stored by the checkpoint itself and stay on the GPU.

Gap filled: torch's `save_on_cpu` copies on the compute stream (the forward waits for each copy);
TRL's and torchtune's activation offloading are designs of the same kind, not a library this
recipe's loop can call. On a CPU there is nothing to move: the hooks only count.
"""

from __future__ import annotations

import contextlib

import torch


class Offloader:
    """Pack and unpack hooks; `moved`/`kept` count the tensors and `moved_bytes` their bytes."""

    def __init__(self, device: torch.device, min_bytes: int = 1 << 20):
        self.device, self.min_bytes = device, min_bytes
        self.moved = self.kept = self.moved_bytes = 0
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.in_flight: list = []  # (GPU tensor, event): kept alive until its copy is done

    def pack(self, tensor: torch.Tensor):
        big = tensor.numel() * tensor.element_size() >= self.min_bytes
        if self.stream is None or not tensor.is_cuda or isinstance(tensor, torch.nn.Parameter) \
                or not big:  # fmt: skip
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
def activations(enabled: bool, device: torch.device, min_bytes: int = 1 << 20):
    """Offload what the forward inside saves for backward (see the module); yields the
    Offloader (None when not enabled)."""
    if not enabled:
        yield None
        return
    offloader = Offloader(device, min_bytes)
    with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
        yield offloader


class _Group:
    """What one decoder layer's forward saved: the slots it moved to host memory."""

    def __init__(self, index: int, rows: int):
        self.index, self.rows, self.slots, self.fetched, self.started = index, rows, [], False, False
        self.pending: list = []  # (GPU tensor, event): alive until its copy to host is done


class _Slot:
    def __init__(self, group: _Group, host: torch.Tensor, done):
        self.group, self.host, self.done, self.gpu, self.ready = group, host, done, None, None


class LayerHost:
    """training.recompute.host_layers: chosen decoder layers keep every matmul's result, and the
    MLP's two widest of them (gate and up: `widths` values per token) wait in pinned host memory
    between forward and backward, so backward neither runs them again nor holds them on the GPU.

        host = LayerHost(widths={14336, 28672}, chosen={0, 2, 4})
        with host.layer(i, rows):    # around decoder layer i's (compiled) forward on rows tokens
            out = layer(...)

    Forward: each tensor a chosen layer saves whose last dimension is one of `widths` is copied to
    pinned host memory on a side stream as soon as the layer's kernels are queued; the GPU copy is
    freed once the host copy is done, and at most `in_flight` layers' copies may be pending (the
    host waits for the oldest: GPU memory stays bounded when the link is slower than compute).
    Backward: when any layer's saved tensors are unpacked, the nearest earlier chosen layer's
    tensors are copied back on the side stream, so they arrive while the layers between run
    backward. Every decoder layer runs under `layer()` (unchosen ones move nothing) so that each
    layer's backward can start the next prefetch.

    Gap filled: torch 2.11's selective checkpoint has no CPU-offload policy (later torch adds
    CheckpointPolicy.MUST_CPU_OFFLOAD), `offload.activations` moves everything with no prefetch,
    and compiled layers save their kept results through the autograd function the compiler
    builds, which these hooks see. On a CPU the "host copy" is a copy in the same memory: the
    bookkeeping runs as on a GPU (tests), nothing is saved."""

    def __init__(self, widths, chosen, in_flight: int = 2):
        self.widths, self.chosen, self.in_flight = set(widths), set(chosen), in_flight
        self.groups: list[_Group] = []  # forward order; a group leaves once fully unpacked
        self.stream, self.current = None, None
        self.moved = self.moved_bytes = self.prefetched = 0
        self.hooks = (self._pack, self._unpack)  # one pair for every layer and step
        self.started: list = []  # backward: a compute-stream event as each layer's backward starts

    @contextlib.contextmanager
    def layer(self, index: int, rows: int):
        """Decoder layer `index`'s forward on `rows` tokens: what it saves of `rows` x a width."""
        group, outer = _Group(index, rows), self.current
        if index in self.chosen:
            self.groups.append(group)
        self.current = group
        try:
            with torch.autograd.graph.saved_tensors_hooks(*self.hooks):
                yield
        finally:
            self.current = outer

    def _wanted(self, group: _Group, t: torch.Tensor) -> bool:
        return (group.index in self.chosen and t.dim() >= 2 and t.shape[-1] in self.widths
                and t.shape[:-1].numel() == group.rows)  # an activation, not a weight

    def _pack(self, t: torch.Tensor):
        group = self.current
        if not self._wanted(group, t):
            return group, t
        if t.is_cuda:
            self.stream = self.stream or torch.cuda.Stream(t.device)
            self._bound(group)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            group.pending.append((t, done))
        else:
            host, done = t.clone(), None
        self.moved += 1
        self.moved_bytes += host.numel() * host.element_size()
        slot = _Slot(group, host, done)
        group.slots.append(slot)
        return slot

    def _bound(self, group: _Group) -> None:
        """Free GPU copies whose host copy is done; if more than `in_flight` layers still have
        copies pending, wait for the oldest."""
        for g in self.groups:
            g.pending = [(t, e) for t, e in g.pending if not e.query()]
        busy = [g for g in self.groups if g.pending and g is not group]
        for g in busy[:max(0, len(busy) - self.in_flight + 1)]:
            g.pending[-1][1].synchronize()
            g.pending = []

    def _fetch(self, group: _Group) -> None:
        group.fetched = True
        for slot in group.slots:
            if slot.done is None:
                slot.gpu = slot.host
                continue
            device = torch.device("cuda", torch.cuda.current_device())
            with torch.cuda.stream(self.stream):  # after its copy out: the same stream
                slot.gpu = slot.host.to(device, non_blocking=True)
                slot.ready = torch.cuda.Event()
                slot.ready.record(self.stream)

    def _unpack(self, packed):
        group, packed = (packed.group, packed) if isinstance(packed, _Slot) else packed
        if torch.cuda.is_available() and self.stream is not None and not group.started:
            group.started = True
            self.started = [*self.started[-1:], torch.cuda.current_stream().record_event()]
        # the nearest earlier chosen layer's tensors start back now, under this layer's backward
        earlier = [g for g in self.groups if g.index < group.index and not g.fetched]
        if earlier:
            # The host queues backward layers ahead of the GPU, and each fetch allocates at queue
            # time memory the GPU frees only once it has run that layer: without a bound, a host
            # many layers ahead held that many layers' gate and up at once (measured on one H100:
            # out of memory at 24 GiB with any number of hosted layers). Wait until the GPU has
            # started the previous layer's backward: at most ~3 layers' are on the GPU.
            if len(self.started) == 2:
                self.started[0].synchronize()
            self._fetch(earlier[-1])
            self.prefetched += 1
        if not isinstance(packed, _Slot):
            return packed
        if not group.fetched:
            self._fetch(group)
        t = packed.gpu
        if packed.ready is not None:
            stream = torch.cuda.current_stream(t.device)
            stream.wait_event(packed.ready)
            t.record_stream(stream)  # allocated on the side stream, used on this one
        packed.gpu = packed.host = None
        group.slots.remove(packed)
        if not group.slots and group in self.groups:
            self.groups.remove(group)
        return t
