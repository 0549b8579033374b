"""Which parameter a gradient belongs to, for the Compressor doors (``TopKEF``, ``PowerSGD``) inside stock
Horovod; their errors name the door (``door``).

Horovod's ``Compressor.compress(tensor)`` receives only the gradient, not its parameter or name.

- ``ParameterKeys`` (``TopKEF(named_parameters=...)``): Horovod hands ``compress`` the parameter's own
  ``.grad`` tensor (the same object), so identity finds its name. Residuals, step counters and index
  sets are then keyed by name: robust to any order of the step (a parameter some rank left unused is
  compressed at ``synchronize()``, two optimizers stepping in turn, ``synchronize()`` called twice).
- ``SlotSequence`` (no names): the i-th compress of a step is slot i, by position, checked against the
  first step's shapes; a gradient tensor compressed in the last step keeps the slot it had there.

Both mark the step's boundaries: Horovod compresses every gradient of a step before it decompresses any.
"""

import weakref

__all__ = ["ParameterKeys", "SlotSequence"]


class ParameterKeys:
    """Gradient tensor -> parameter name, from ``named_parameters``; tracks the step's keys."""

    def __init__(self, named_parameters, door="TopKEF"):
        self.door = door           # the Compressor's class name, as the errors name it
        pairs = list(named_parameters)
        if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
            raise ValueError("named_parameters must be (name, parameter) pairs, as model.named_parameters() gives")
        self.params = dict(pairs)
        if len(self.params) != len(pairs):
            raise ValueError("named_parameters: parameter names must be unique")
        self.key_index = {name: i for i, name in enumerate(sorted(self.params))}   # same on all ranks
        self.by_grad = {}          # id(p.grad) -> name, refreshed when a lookup misses
        self.keys = []             # keys handed out in the current step
        self.previous = None       # keys of the last complete step
        self.pending = 0           # compressed but not yet decompressed in the current step
        self.decompressing = False
        self.interrupted = False   # the last step was abandoned (a failed collective, an elastic reset)

    def next_key(self, tensor):
        """The name of the parameter whose gradient ``tensor`` is."""
        self._maybe_new_step()
        name = self.by_grad.get(id(tensor))
        if name is None or self.params[name].grad is not tensor:
            self.by_grad = {id(p.grad): n for n, p in self.params.items() if p.grad is not None}
            name = self.by_grad.get(id(tensor))
            if name is None or self.params[name].grad is not tensor:
                name = self._densified(tensor)
        if name in self.keys and not self.decompressing:
            # Compressed twice with no decompress between: Horovod never finished the last step (its
            # collective failed and elastic Horovod reset); this is a new step.
            self.keys, self.pending, self.interrupted = [], 0, True
        self.keys.append(name)
        self.pending += 1
        return name

    def _densified(self, tensor):
        """With ``sparse_as_dense=True`` Horovod compresses ``p.grad.to_dense()``, a new tensor: the
        parameter is the one whose gradient is sparse with this shape, if only one is."""
        matches = [n for n, p in self.params.items()
                   if p.grad is not None and p.grad.is_sparse and tuple(p.grad.shape) == tuple(tensor.shape)]
        if len(matches) != 1:
            raise ValueError(f"{self.door}: a gradient of shape {tuple(tensor.shape)} is the .grad of none of the "
                             f"named_parameters given to {self.door}; give it the same model's "
                             "model.named_parameters() as the optimizer")
        return matches[0]

    def _maybe_new_step(self):
        if self.decompressing:
            if self.pending:
                raise RuntimeError(f"{self.door}: a new step started with {self.pending} gradient(s) of the previous "
                                   "step never decompressed; let Horovod's synchronize() finish every step")
            self.previous, self.keys, self.decompressing = set(self.keys), [], False

    def restore(self, signatures):
        """A checkpoint was loaded: the next compress starts a step (named keys need no signatures)."""
        self.keys, self.previous, self.pending, self.decompressing = [], None, 0, False

    def registration_order(self):
        """The keys in the order the model registered them (identical on every rank)."""
        return list(self.params)

    def step_complete(self):
        """True once this step has compressed every key the last step did (its index sets can leave)."""
        return self.previous is not None and len(self.keys) == len(self.previous) and set(self.keys) == self.previous

    def finish_one(self):
        self.decompressing = True
        self.pending -= 1


class SlotSequence:
    """Gives each ``compress()`` call of a step its slot, by position, and checks the sequence.

    Horovod's ``Compressor.compress(tensor)`` receives only the gradient, not its parameter. Within a
    step Horovod compresses every gradient (in backward-hook order) before it decompresses any, so the
    i-th compress of a step belongs to the i-th parameter of the first step. The first step records
    each slot's (shape, dtype, device); later steps must match it exactly, or we raise instead of
    applying a residual to the wrong tensor.

    One exception to "by position": a tensor that is the very object compressed in the last step (it
    is still alive, so it is still that parameter's ``.grad``) keeps its slot. ``optimizer.step()``
    after ``optimizer.synchronize()`` without ``skip_synchronize()`` makes Horovod reduce every
    gradient again, iterating a set of parameters, whose order differs between processes; by position,
    the ranks would then key the same gradient differently. (Fresh gradients, the usual case after
    ``zero_grad()``, are matched by position as before.)
    """

    def __init__(self, door="TopKEF"):
        self.door = door           # the Compressor's class name, as the errors name it
        self.key_index = _SlotIndex()  # STAR's tensor index: the slot itself
        self.signatures = []      # (shape, dtype, device) per slot; complete after the first step
        self.complete = False     # True once the first step has reached decompress
        self.position = 0         # slots handed out in the current step
        self.pending = 0          # compressed but not yet decompressed in the current step
        self.decompressing = False
        # id(tensor) -> (weak reference, slot): weak, so that no gradient is kept alive, and checked by
        # identity, so that a new tensor at a reused address is not taken for the old one
        self.last, self.current = {}, {}
        self.taken = set()        # slots handed out in the current step

    def next_slot(self, tensor):
        """Slot of the next gradient of this step; raises ValueError if the sequence changed."""
        if self.decompressing:
            if self.pending:
                raise RuntimeError(
                    f"{self.door}: a new step started with {self.pending} gradient(s) of the previous "
                    f"step never decompressed; use one {self.door} instance per optimizer, with "
                    "named_parameters=model.named_parameters(), and let Horovod's synchronize() finish every step")
            self.decompressing = False
            self.position = 0
            self.last, self.current, self.taken = self.current, {}, set()
        signature = (tuple(tensor.shape), tensor.dtype, tensor.device)
        slot = self._slot_of_same_tensor(tensor)
        if slot is None:
            slot = self.position
        if not self.complete:
            self.signatures.append(signature)
        elif slot in self.taken:
            raise ValueError(
                f"{self.door}: slot #{slot} is handed out twice in this step: the gradients came in another "
                "order than in the last step, and not all of them are the last step's tensors. Without names "
                f"{self.door} keeps residuals by position; give it named_parameters=model.named_parameters()")
        elif slot >= len(self.signatures):
            raise ValueError(
                f"{self.door}: this step compresses more gradients than the first step "
                f"({len(self.signatures)}); the model or its trainable parameters changed. "
                f"Give {self.door} named_parameters=model.named_parameters(), one {self.door} per optimizer: "
                "without names its residuals are kept by position")
        elif self.signatures[slot] != signature:
            raise ValueError(
                f"{self.door}: gradient #{slot} of this step has shape/dtype/device {signature}, but "
                f"slot #{slot} holds a residual for {self.signatures[slot]}; the sequence of "
                "gradients changed (different model, or a parameter frozen mid-run). Refusing to "
                f"apply a residual to the wrong tensor; with {self.door}(named_parameters=model.named_parameters()) "
                "residuals are kept by parameter name instead")
        self.current[id(tensor)] = (weakref.ref(tensor), slot)
        self.taken.add(slot)
        self.position += 1
        self.pending += 1
        return slot

    def _slot_of_same_tensor(self, tensor):
        """The slot ``tensor`` had in the last step if it is that very object, else None."""
        ref, slot = self.last.get(id(tensor), (None, None))
        return slot if ref is not None and ref() is tensor else None

    def next_key(self, tensor):
        return self.next_slot(tensor)

    def restore(self, signatures):
        """A checkpoint was loaded: the slots of its first step, and a step boundary."""
        self.signatures, self.complete = list(signatures), bool(signatures)
        self.position = self.pending = 0
        self.decompressing = False
        self.last, self.current, self.taken = {}, {}, set()

    def registration_order(self):
        """The slots from the last: slot 0 is the first gradient ready, the last registered (backward
        runs from the last layer)."""
        return list(reversed(range(len(self.signatures))))

    def step_complete(self):
        """True once this step has handed out every slot of the first step."""
        return self.complete and self.position == len(self.signatures)

    def finish_one(self):
        """Record one decompress; on the first of a step, check the step had every slot."""
        if not self.decompressing:
            self.decompressing = True
            if not self.complete:
                self.complete = True
            elif self.position != len(self.signatures):
                raise ValueError(
                    f"{self.door}: this step compressed {self.position} gradients, the first step "
                    f"{len(self.signatures)}; the model or its trainable parameters changed (use "
                    f"{self.door}(named_parameters=model.named_parameters()), one per optimizer)")
        self.pending -= 1


class _SlotIndex(dict):
    """STAR's tensor index of a slot: the slot itself."""

    def __missing__(self, slot):
        return slot
