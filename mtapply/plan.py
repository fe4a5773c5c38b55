"""Plans: tensor lists bound once to an op, stepped many times.

A Plan validates and ingests its lists once, groups them into launches, compiles the kernels and
uploads the pointer tables. `step()` then does O(1) host work: it checks the hyperparameters,
writes a few argument words and issues one launch per group. `rebind()` swaps one slot's
tensors (e.g. freshly allocated grads) and re-uploads only the tables.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict

import numpy as np

from . import _cpu, _tables
from ._dlpack import export, framework_of
from ._launch import stream_and_owner
from ._devices import Devices, Shared
from ._launcher import Launcher, launcher_for
from ._ranges import GRAD_SCALE, STEP
from ._repeat import Repeat, repeatable
from ._rows import Rows, rows_for
from ._torch_fast import torch_ref
from ._validate import check_lists, check_no_overlap, ingest, ingest_slot
from .ops._spec import DeviceScalar, OutputArray, check_number
from .ops.scaling import AddSpec


_SCALARS_KEPT = 8
_CLOSED = "this plan was closed (Plan.close): build a new plan"


def _freed(slot: str, index: int) -> str:
    return (f"{slot}[{index}] was freed after plan.release({slot!r}): a step would write freed "
            f"memory. Bind {slot!r} to live tensors again (plan.rebind), or build a new plan")


class _Lost:
    """Notes, in a plan it does not keep alive, which released tensor was freed."""

    __slots__ = ("plan", "slot")

    def __init__(self, plan: weakref.ref, slot: str):
        self.plan, self.slot = plan, slot

    def callback(self, index: int):
        def freed(_reference, lost=self, index=index) -> None:
            plan = lost.plan()
            if plan is not None:
                plan._tensor_freed(lost.slot, index)

        return freed


class Plan:
    """Tensor lists bound to one op (see `mtapply.adam_plan`).

    Args:
        spec: the op specification (e.g. `mtapply.ops.AdamSpec(amsgrad=True)`).
        tensors: slot name -> list of tensors, in the spec's slot order.
        table_mode: "memcpy" or "unified" (default: $MTAPPLY_TABLE_MODE, else "memcpy"; the
            variable is read, and checked, only by a plan on a GPU).
        stream: default launch stream; None means the tensors' framework's current stream.

    Device values: a hyperparameter, `grad_scale` or `found_inf` may be a one-element float32
    array on the tensors' device (the same on the CPU), read when the step runs, so a step
    never waits for the host. Each op declares the range of each such value (`OpSpec.ranges`:
    lr finite and >= 0, step a whole number >= 1, grad_scale finite and > 0, ...). A number out
    of its range is refused at once (ValueError); a device value out of its range is found by
    the step itself, which then writes nothing, as with found_inf set (a plan that counts its
    steps does not count it), and sets `plan.invalid` to 1: a one-element float32 array the
    caller reads when it likes, without a sync (`clear_invalid` zeroes it).

    Lifetime: the plan holds its tensors unless `release(slot)` hands them to the caller; a step
    after one of them was freed is refused. `close()` gives the device memory back (once the
    launches queued so far have run) and refuses every later call. A plan holds device memory
    and raw addresses: copying or pickling one is refused (build a new plan over the copies).
    Its methods may be called from several threads: they run one at a time (a lock), and the
    GPU work of steps on different streams is ordered as they were called.
    """

    def __init__(self, spec, tensors: dict, *, table_mode: str | None = None, stream=None):
        missing = [name for name in spec.slots if tensors.get(name) is None]
        if missing:
            raise TypeError(f"{missing[0]} is required by {spec.name} with these options: pass a "
                            f"list of tensors with one per param")
        self.spec = spec
        if table_mode and table_mode not in _tables.MODES:
            raise ValueError(f"table_mode={table_mode!r}; use one of {', '.join(_tables.MODES)}")
        self.table_mode = table_mode or None  # None: $MTAPPLY_TABLE_MODE, read by GPU plans only
        self._stream = stream
        self._stream_owners: dict = {}  # device -> the objects owning its latest two streams
        slots = {name: tensors[name] for name in spec.slots}
        first = spec.slots[0]
        self._framework = framework_of(slots[first][0]) if check_lists(slots) else "none"
        self._refs = ingest(slots, spec.written, lambda device: self._stream_for(device[1], stream),
                            spec.slot_formats)
        spec.check_tensors(self._refs)  # per-tensor options (e.g. LARS exclude), master dtypes
        self._n = len(self._refs[first])
        self._addresses = {name: np.fromiter((r.ptr for r in refs), np.uint64, self._n)
                           for name, refs in self._refs.items()}
        self._sizes: dict = {}
        self._alive: dict = {}
        self._written_extents = None  # sorted (starts, ends) of the written slots' tensors
        self._released: set = set()  # slots whose TensorRefs no longer hold their tensors
        self.device = self._refs[first][0].device if self._n else None
        # of the sums and of the scalar state (`scalars_out`): float64 for a rule over float64
        self.sum_dtype = spec.sum_dtype(r.dtype for r in self._refs[first])
        self._scalars: OrderedDict = OrderedDict()
        self._latest_rows = None  # the rows of the latest step's per-tensor hyperparameters
        self._cpu_cache: dict = {}  # the CPU backend's views of the tensors (see `_cpu.run`)
        self._cpu_sums = None  # on the CPU, the sums a step with after_pass takes first
        self._cuda = None
        if self.device is not None and self.device[0] == "cuda":
            self._cuda = self._launchers(stream)
        self._repeat = None  # the latest launching step on one GPU (`Repeat`)
        self._counter = None  # where the plan keeps its step count (`count_steps`)
        self._lock = threading.RLock()
        self._refusal = None  # why every call is refused now (closed; a released tensor freed)
        self._watched: dict = {}  # released slot -> weak references to its tensors
        self._lost: dict = {}  # released slot -> index of a tensor freed since
        self._invalid_host = np.zeros(1, np.float32)  # `invalid` of a plan without a GPU

    def __reduce_ex__(self, protocol):
        raise TypeError("a Plan holds device memory and the addresses of its tensors: it cannot "
                        "be copied or pickled. Build a new plan over the copied tensors (e.g. "
                        "mtapply.adam_plan(...)) instead")

    def _launchers(self, stream):
        """The launcher of the plan's GPU, or of each of its GPUs (one launch set per device,
        each device's tables on that device)."""
        self.table_mode = self.table_mode or _tables.default_mode()
        arrays = self.spec.tensor_arrays(self._n)
        parts = _parts_by_device(self._refs[self.spec.slots[0]])
        if len(parts) == 1:
            device_id = parts[0][0]
            return launcher_for(self.spec, self._refs, arrays, self.table_mode, device_id,
                                self._stream_for(device_id, stream))
        labels = ', '.join(f'cuda:{d}' for d in dict.fromkeys(d for d, _ in parts))
        shared = self.spec.shared
        if self.spec.single_device:
            raise ValueError(f"{self.spec.name} sums over the whole list, which here spans GPUs "
                             f"{labels}: call it once per GPU")
        if stream is not None:
            raise ValueError(f"stream= names one stream, but the tensors are on GPUs {labels}: "
                             f"leave it None to launch on each device's current stream")
        launchers = []
        for device_id, indices in parts:
            refs = {name: [column[i] for i in indices] for name, column in self._refs.items()}
            subset = {name: np.asarray(values)[indices] for name, values in arrays.items()}
            launchers.append((device_id, indices, launcher_for(
                self.spec, refs, subset, self.table_mode, device_id,
                self._stream_for(device_id, None), self.sum_dtype if shared else None)))
        if not shared:
            return Devices(launchers)
        return Devices(launchers, Shared(launchers, self.spec.n_totals,
                                         self.spec.output_numel("scalars_out", self._n),
                                         self.sum_dtype,
                                         lambda device_id: self._stream_for(device_id, None)))

    def __len__(self) -> int:
        return self._n

    @property
    def spans_devices(self) -> bool:
        """Whether the plan's tensors are on several GPUs (a launch set per device)."""
        return isinstance(self._cuda, Devices)

    def __repr__(self) -> str:
        """The op and its compile-time options, the tensors, their devices, their dtypes (one
        group per combination over the slots, in slot order) and the table mode, e.g.
        `<mtapply Plan adam (decoupled): 148 tensors on cuda:0, float32 x148,
        table_mode=memcpy>`."""
        options = self.spec.options
        slots = [self._refs[name] for name in self.spec.slots]
        devices = dict.fromkeys(_device_label(ref.device) for ref in slots[0])
        groups: dict = {}
        for refs in zip(*slots):
            kinds = tuple(dict.fromkeys(ref.dtype for ref in refs))
            groups[kinds] = groups.get(kinds, 0) + 1
        op = self.spec.name + (f" ({', '.join(options)})" if options else "")
        where = f" on {', '.join(devices)}" if devices else ""
        dtypes = "".join(f", {'/'.join(kinds)} x{count}" for kinds, count in groups.items())
        return (f"<mtapply Plan {op}: {self._n} tensor{'' if self._n == 1 else 's'}{where}"
                f"{dtypes}, table_mode={self.table_mode or _tables.configured_mode()}>")

    @property
    def empty(self) -> bool:
        """True when no tensor has an element: a step launches nothing."""
        return not self._n or not any(ref.numel for ref in self._refs[self.spec.slots[0]])

    def forget_stream(self) -> None:
        """Steps without `stream=` launch on the framework's current stream from now on."""
        with self._lock:
            self._forget_stream()

    def _forget_stream(self) -> None:
        self._stream = None
        self._repeat = None
        if self._counter is not None and self._counter.alone is not None:
            self._counter.alone.forget_stream()

    def _relaunch_is_the_step(self) -> bool:
        """Whether launching the latest step's launches again is the whole of a step (not
        where the step count is advanced apart from them)."""
        return self._counter is None or self._counter.alone is None

    def count_steps(self, counter) -> None:
        """Keeps the plan's step count in `counter`, a one-element float32 array on the plan's
        device that holds the steps taken. Each step then takes one more than it holds as its
        `step` (pass no `step=`, or `counter` itself) and advances it, unless `found_inf`
        skips the step; on a GPU the step's own launches do both, so a training loop's
        counter costs no launch of its own."""
        with self._lock:
            self._open()
            if "step" not in self.spec.device_scalars:
                raise ValueError(f"{self.spec.name} takes no step count: count_steps does not "
                                 f"apply")
            if isinstance(self._cuda, Devices):
                raise ValueError("count_steps needs the plan's tensors on one GPU; the counter "
                                 "is read by every launch")
            self._counter = StepCounter(self, counter)
            self._repeat = None  # the launches' words change

    def step(self, *, stream=None, grad_scale=None, found_inf=None, after_pass=None,
             **hyper) -> None:
        """Applies the op once to every tensor. Hyperparameters as the op's step function takes.

        AMP (torch.amp.GradScaler's conventions): grads are divided by `grad_scale`, and when
        `found_inf` is non-zero nothing is written. Each may be a number or a one-element float32
        device array read by the kernel (so the step never waits for the host).

        `after_pass(k)`, for ops of several passes on one GPU, is called on the host once pass k
        is enqueued and before pass k + 1: it may enqueue work on the launch stream, such as an
        all-reduce of `first_pass_sums()` across the ranks that hold shards of the same
        tensors. On the CPU, for an op with sums, it is called once they are taken (k = 0).

        A device value out of its range (see the class's docstring) skips the step and sets
        `invalid`; a number out of its range raises ValueError before anything is written.
        """
        with self._lock:
            if self._refusal is not None:
                raise RuntimeError(self._refusal)
            counter = self._counter
            if counter is None:
                self._step(stream, grad_scale, found_inf, after_pass, hyper)
                return
            counted = counter.hyper(hyper)
            if counted is None:  # the host counter holds no step count: as a kernel would
                self._invalid_host[0] = 1.0
                return
            if self._step(stream, grad_scale, found_inf, after_pass, counted) is not False:
                if counter.alone is not None:
                    counter.alone.step(value=1.0, found_inf=found_inf, stream=stream)

    def _step(self, stream, grad_scale, found_inf, after_pass, hyper: dict):
        """The step; False where the CPU found a device value out of its range."""
        repeat = self._repeat
        if repeat is not None and after_pass is None:
            changed = repeat.changes(self, stream, grad_scale, found_inf, hyper)
            # the latest step again, or with other numbers
            if changed is not None and (not changed or repeat.renumber(self, hyper, changed)):
                repeat.launch()
                return
        rows = self._rows(hyper)
        if rows is not None and not len(rows.firsts):
            return  # no tensor: nothing to check the per-tensor values against
        args = rows.first if rows else self.spec.arguments(
            **{k: self._scalar(k, v) for k, v in hyper.items()})
        scale = 1.0 if grad_scale is None else self._scalar("grad_scale", grad_scale)
        if not isinstance(scale, DeviceScalar):
            scale = GRAD_SCALE.check("grad_scale", scale)
        skip = None if found_inf is None else self._scalar("found_inf", found_inf)
        if skip is not None and not isinstance(skip, DeviceScalar):
            if check_number("found_inf", skip) != 0:
                return  # known on the host: no launch at all
            skip = None
        if self._n == 0:
            return
        if self._cuda is None:
            first_pass = None
            if after_pass is not None and self.spec.n_sums:  # (the sums, then the hook)
                first_pass = (self.first_pass_sums(), after_pass)
            if not _cpu.run(self.spec, self._refs, args, grad_scale=scale, rows=rows,
                            found_inf=skip, cache=self._cpu_cache, first_pass=first_pass):
                self._invalid_host[0] = 1.0
                return False
        else:
            chosen = self._stream if stream is None else stream
            if after_pass is not None and isinstance(self._cuda, Devices):
                raise ValueError("after_pass needs the plan's tensors on one GPU")
            self._repeat = None  # (also where the launches below are interrupted)
            self._cuda.run(args, lambda device_id: self._stream_for(device_id, chosen), scale, skip,
                           after_pass, rows)
            if isinstance(self._cuda, Launcher) and after_pass is None and repeatable(hyper,
                                                                                    rows):
                self._repeat = Repeat(self, stream, grad_scale, found_inf, hyper, (scale, skip),
                                       rows)

    def _rows(self, hyper: dict) -> Rows | None:
        """The checked rows where hyperparameters are given per tensor, else None. On a GPU
        the latest step's rows are reused, or patched, while the values allow it (device values
        by identity: the kernel reads them); on the CPU a device value is read when checked."""
        rows = rows_for(self.spec, hyper, self._n, self._scalar,
                        self._latest_rows if self._cuda is not None else None)
        if rows is not None and self.spec.uniform_hyper:
            raise ValueError(f"{self.spec.name} takes each hyperparameter for all tensors: give one "
                             f"number, not one per tensor")
        self._latest_rows = rows
        return rows

    def sums(self):
        """The per-tensor sums that a multi-pass op's first pass leaves for the next (LARS:
        ||p||^2 and ||g||^2; LAMB: ||p||^2 and ||u||^2), as a CuPy array of (tensors, sums)
        in the plan's own group order (of `sum_dtype`); None for ops without sums or plans not
        on one GPU."""
        self._open()
        if not isinstance(self._cuda, Launcher) or self._cuda.all_sums is None:
            return None
        import cupy

        return cupy.ndarray((self._n, self.spec.n_sums), self._cuda.sum_dtype,
                            self._cuda.all_sums)

    def first_pass_sums(self):
        """Everything a first pass leaves for the update: the per-tensor sums (`sums`), then the
        whole-list sums (a rule's totals), as one flat CuPy array (on the CPU a NumPy array,
        filled where a step is given `after_pass`); None for ops without sums or plans over
        several GPUs. Summing it over processes between the passes (`after_pass`) gives the
        sums of tensors sharded over them."""
        self._open()
        if self._cuda is None and self.spec.n_sums:
            if self._cpu_sums is None:
                self._cpu_sums = np.zeros(self._n * self.spec.n_sums + self.spec.n_totals,
                                          self.sum_dtype)
            return self._cpu_sums
        if not isinstance(self._cuda, Launcher) or self._cuda.all_sums is None:
            return None
        import cupy

        return cupy.ndarray((self._n * self.spec.n_sums + self.spec.n_totals,),
                            self._cuda.sum_dtype, self._cuda.all_sums)

    @property
    def invalid(self):
        """A one-element float32 array that a step sets to 1 when a device value it was given
        is out of its range (the step then wrote nothing). It stays set until `clear_invalid`.
        A CuPy array on the plan's GPU (torch.from_dlpack reads it in place), a NumPy array on
        the CPU; for a plan over several GPUs, a tuple of one per GPU, in device order."""
        self._open()
        if self._cuda is None:
            return self._invalid_host
        return self._cuda.invalid_flags()

    def clear_invalid(self, *, stream=None) -> None:
        """Zeroes `invalid`, on the launch stream (ordered after the steps queued so far)."""
        with self._lock:
            self._open()
            if self._cuda is None:
                self._invalid_host[0] = 0.0
                return
            chosen = self._stream if stream is None else stream
            self._cuda.clear_invalid(lambda device_id: self._stream_for(device_id, chosen))
            self._repeat = None  # the next step orders itself after the clearing

    def rebind(self, slot: str, tensors, *, stream=None) -> None:
        """Points `slot` at new tensors of the same shapes and dtypes, keeping everything else.
        A refused rebind (a bad tensor, a wrong count) leaves the plan bound as it was."""
        with self._lock:
            self._open()
            if slot not in self.spec.slots:
                raise ValueError(f"{slot!r} is not a slot of {self.spec.name}; slots are "
                                 f"{', '.join(self.spec.slots)}")
            check_lists({slot: tensors})
            if len(tensors) != self._n:
                first = self.spec.slots[0]
                bound = "the plan" if slot == first else first
                raise ValueError(f"{slot} has {len(tensors)} tensors but {bound} has {self._n}: "
                                 f"pass one {slot} tensor per {first[:-1] or first}")
            chosen = self._stream if stream is None else stream
            launch_stream = ((lambda device: self._stream_for(device[1], chosen))
                             if self._cuda else None)
            fresh = ingest_slot(slot, tensors, self._refs[slot], slot in self.spec.written,
                                launch_stream)
            addresses = np.fromiter((ref.ptr for ref in fresh), np.uint64, len(fresh))
            check_no_overlap(self._extents({slot: addresses}), self.spec.written)
            if self._cuda is not None:  # raises, changing nothing, where it cannot upload
                self._cuda = self._cuda.rebound({self.spec.slots.index(slot): addresses},
                                                lambda device_id: self._stream_for(device_id,
                                                                                   chosen))
            self._repeat = None  # the tables changed
            self._refs[slot] = fresh
            self._cpu_cache.clear()
            self._released.discard(slot)
            self._alive.pop(slot, None)
            self._addresses[slot] = addresses
            self._bound_again(slot)
            if slot in self.spec.written:
                self._written_extents = None

    def rebind_addresses(self, slot: str, tensors: list, addresses: np.ndarray, *, stream=None,
                         keep_alive: bool = True) -> None:
        """`rebind` for callers that guarantee what `rebind` checks tensor by tensor: each new
        tensor has the dtype, shape, device and dense layout of the one it replaces (e.g. the
        grads autograd gives a framework's params). `addresses` holds their data pointers.
        Only overlaps are checked (vectorised): O(n) at tens of nanoseconds per tensor. With
        keep_alive=False the plan does not hold the tensors: the caller keeps them alive while
        they are bound (as an optimizer's params hold their grads).
        """
        with self._lock:
            if self._cuda is None:
                self.rebind(slot, tensors, stream=stream)
                return
            self.rebind_columns({slot: addresses}, stream=stream)
            if keep_alive:
                self._alive[slot] = tensors  # the plan keeps its tensors alive
            else:
                self._alive.pop(slot, None)

    def rebind_columns(self, moved: dict, *, stream=None) -> None:
        """`rebind_addresses` of several slots at once (slot -> addresses), for tensors that the
        caller holds alive: every overlap is checked before anything changes, then the tables
        are uploaded once."""
        with self._lock:
            self._open()
            for slot in moved:
                if slot not in self.spec.slots:
                    raise ValueError(f"{slot!r} is not a slot of {self.spec.name}; slots are "
                                     f"{', '.join(self.spec.slots)}")
            moved = {slot: np.asarray(addresses, np.uint64) for slot, addresses in moved.items()}
            for slot, addresses in moved.items():
                if addresses.shape != (self._n,):
                    raise ValueError(f"{slot} has {len(addresses.reshape(-1))} addresses but the "
                                     f"plan has {self._n} tensors")
            if self.spec.written & set(moved):
                check_no_overlap(self._extents(moved), self.spec.written)
            else:
                for slot, addresses in moved.items():
                    self._check_against_written(slot, addresses)
            chosen = self._stream if stream is None else stream
            columns = {self.spec.slots.index(slot): addresses for slot, addresses in moved.items()}
            self._cuda = self._cuda.rebound(columns,
                                            lambda device_id: self._stream_for(device_id, chosen))
            self._repeat = None  # the tables changed
            for slot in moved:
                self._alive.pop(slot, None)
                self._bound_again(slot)
            self._addresses.update(moved)
            if self.spec.written & set(moved):
                self._written_extents = None

    def release(self, slot: str, *, watch: bool = True) -> None:
        """Drops the plan's references to the tensors bound to `slot` (their addresses stay):
        the caller then keeps them alive while the plan may launch on them. Where one of them
        is freed all the same, later steps are refused (RuntimeError) until `slot` is bound
        again (`rebind`): a step would write freed memory. `watch=False` is for a caller that
        itself follows the memory behind the tensors it gave (views of its own tensors, say)
        and rebinds before a step where it moved: nothing is then watched."""
        with self._lock:
            if slot not in self.spec.slots:
                raise ValueError(f"{slot!r} is not a slot of {self.spec.name}; slots are "
                                 f"{', '.join(self.spec.slots)}")
            self._alive.pop(slot, None)
            if slot not in self._released and self._refusal != _CLOSED:
                if watch:
                    self._watch(slot)
                self._refs[slot] = [dataclasses.replace(ref, obj=None) for ref in self._refs[slot]]
                self._cpu_cache.clear()
                self._released.add(slot)

    def close(self) -> None:
        """Lets the plan go: its tensors are no longer held, its device memory goes back to
        the pool once the launches queued so far have run, and every later call is refused."""
        with self._lock:
            self._refusal = _CLOSED
            self._cuda = self._repeat = self._counter = self._latest_rows = None
            self._refs = {name: [] for name in self._refs}
            self._cpu_cache.clear()
            self._alive, self._watched, self._lost = {}, {}, {}
            self._scalars.clear()

    def _watch(self, slot: str) -> None:
        """Weak references to the tensors of `slot`, which note any of them that is freed."""
        lost = _Lost(weakref.ref(self), slot)
        watched = []
        for index, ref in enumerate(self._refs[slot]):
            try:
                watched.append(weakref.ref(ref.obj, lost.callback(index)))
            except TypeError:  # an object without weak references: the caller's word only
                pass
        self._watched[slot] = watched

    def _tensor_freed(self, slot: str, index: int) -> None:
        if self._refusal != _CLOSED and slot in self._watched:
            self._lost.setdefault(slot, index)
            self._refusal = self._refusal or _freed(slot, self._lost[slot])

    def _bound_again(self, slot: str) -> None:
        """`slot` holds tensors the caller just gave: freed ones no longer count."""
        self._watched.pop(slot, None)
        if self._lost.pop(slot, None) is not None and self._refusal != _CLOSED:
            self._refusal = _freed(*next(iter(self._lost.items()))) if self._lost else None

    def _vouch_alive(self) -> None:
        """The caller has checked that live tensors lie at the plan's addresses (the one-call
        API's memory): tensors freed since `release` no longer count."""
        with self._lock:
            if self._refusal != _CLOSED:
                self._lost.clear()
                self._refusal = None

    def _open(self) -> None:
        """Refused once closed (a rebind writes no tensor: it may follow a freed one)."""
        if self._refusal == _CLOSED:
            raise RuntimeError(_CLOSED)

    def _check_against_written(self, slot: str, addresses: np.ndarray) -> None:
        """A read-only slot's new tensors against the written tensors (which never overlap one
        another): one binary search per tensor in their sorted extents, kept between calls."""
        if not self.spec.written & set(self._refs):
            return
        if self._written_extents is None:
            names = sorted(self.spec.written & set(self._refs))
            extents = self._extents({slot: addresses})
            starts = np.concatenate([extents[n][0] for n in names])
            sizes = np.concatenate([extents[n][1] for n in names])
            keep = np.flatnonzero(sizes)
            order = keep[np.argsort(starts[keep], kind="stable")]
            self._written_extents = (starts[order], starts[order] + sizes[order])
        written_starts, written_ends = self._written_extents
        if not len(written_starts):
            return  # every written tensor is empty
        sizes = self._extents({slot: addresses})[slot][1]
        ends = addresses + sizes
        before = np.searchsorted(written_starts, ends, side="left") - 1
        hit = (sizes > 0) & (before >= 0) & (written_ends[np.maximum(before, 0)] > addresses)
        if hit.any():
            check_no_overlap(self._extents({slot: addresses}), self.spec.written)  # names the pair

    def _extents(self, moved: dict) -> dict:
        """slot -> (start addresses, sizes in bytes), with the slots of `moved` at its addresses."""
        if not self._sizes:
            self._sizes = {name: np.fromiter((r.nbytes for r in refs), np.uint64, len(refs))
                           for name, refs in self._refs.items()}
        return {name: (moved.get(name, self._addresses[name]), self._sizes[name])
                for name in self._refs}

    def _stream_for(self, device_id: int, stream) -> int:
        """The stream handle to launch on. The objects owning the latest two streams stay
        referenced: a CuPy stream dies with its object, and a launch on another stream than
        the latest first orders itself after the latest one's work (`_tables.wait_for`)."""
        handle, owner = stream_and_owner(stream, self._framework, device_id)
        if owner is not None:
            older, newer = self._stream_owners.get(device_id, (None, None))
            if owner is not newer:
                self._stream_owners[device_id] = (newer, owner)
        return handle

    def _scalar(self, name: str, value):
        """A number stays a number; a one-element float32 array on the plan's device (the CPU
        too) becomes a DeviceScalar; an array for an `*_out` argument becomes an OutputArray."""
        if type(value) is float or type(value) is int or not hasattr(value, "__dlpack__"):
            return value
        if name.endswith("_out") and name in self.spec.outputs:
            return self._output(name, value)
        if name not in self.spec.device_scalars + ("grad_scale", "found_inf"):
            raise TypeError(f"{name} must be a Python number; only "
                            f"{', '.join(self.spec.device_scalars)} may be device arrays")
        cached = self._scalars.get(id(value))
        if cached is not None and cached.obj is value:
            self._scalars.move_to_end(id(value))
            return cached
        ref = _read_array(value, name)
        if isinstance(self._cuda, Devices):
            raise ValueError(f"{name} as a device array is read by every launch, but the tensors "
                             f"are on several GPUs: pass a number, or one plan per GPU")
        count = 1 if name in ("grad_scale", "found_inf") else self.spec.scalar_count(name)
        if (ref.dtype != "float32" or ref.numel != count
                or (self.device is not None and ref.device != self.device)):
            where = "the tensors' device" if self.device is None else _device_label(self.device)
            size = "one-element" if count == 1 else f"{count}-element"
            raise ValueError(f"{name} as a device array must be a {size} float32 array on "
                             f"{where}, got {ref.dtype} {ref.shape} on "
                             f"{_device_label(ref.device)}")
        scalar = DeviceScalar(ptr=ref.ptr, obj=value)  # read, and checked, when the step runs
        self._remember(value, scalar)
        return scalar

    def _remember(self, value, converted) -> None:
        """Keeps the last few converted arrays (a training loop passes the same ones again),
        and no more: per-step arrays such as GradScaler's would otherwise pile up."""
        self._scalars[id(value)] = converted
        while len(self._scalars) > _SCALARS_KEPT:
            self._scalars.popitem(last=False)


    def _output(self, name: str, value) -> OutputArray:
        cached = self._scalars.get(id(value))
        if cached is not None and cached.obj is value:
            self._scalars.move_to_end(id(value))
            return cached
        ref = _read_array(value, name)
        numel = self.spec.output_numel(name, self._n)
        if (ref.dtype != self.sum_dtype or ref.numel != numel
                or (numel > 1 and not ref.row_major) or ref.read_only
                or (self.device is not None and ref.device != self.device)):
            where = "the tensors' device" if self.device is None else _device_label(self.device)
            why = (" (the params are all float64: the state keeps their precision; make it "
                   "with initial_scalars(numpy.float64))" if self.sum_dtype == "float64" else "")
            raise ValueError(f"{name} must be a writable contiguous {self.sum_dtype} array of "
                             f"{numel} element(s) on {where}, got {ref.dtype} {ref.shape} on "
                             f"{_device_label(ref.device)}{why}")
        output = OutputArray(ptr=ref.ptr, obj=value, ref=ref)
        self._remember(value, output)
        return output


def _read_array(value, name: str):
    """The TensorRef of a scalar or output array. torch's accessors first: a DLPack export with
    no stream would order against the legacy default stream, which breaks CUDA graph capture."""
    ref = torch_ref(value) if framework_of(value) == "torch" else None
    return ref if ref is not None else export(value, name, None)


def _parts_by_device(params: list) -> list:
    """(device id, the positions of its tensors) per GPU of the params, in order of first use."""
    of_device = np.fromiter((ref.device[1] for ref in params), np.int64, len(params))
    return [(int(d), np.flatnonzero(of_device == d)) for d in dict.fromkeys(of_device.tolist())]


def _device_label(device: tuple) -> str:
    return "cpu" if device[0] == "cpu" else f"cuda:{device[1]}"


class StepCounter:
    """A plan's step count, kept in a one-element float32 array (`Plan.count_steps`). On a GPU
    the plan's launches read and advance it; on the CPU, or where nothing launches, the step
    reads it on the host and an add advances it (`alone`)."""

    def __init__(self, plan: Plan, counter):
        ref = _read_array(counter, "counter")
        if (ref.dtype != "float32" or ref.numel != 1 or ref.read_only
                or (plan.device is not None and ref.device != plan.device)):
            where = "the tensors' device" if plan.device is None else _device_label(plan.device)
            raise ValueError(f"counter must be a writable one-element float32 array on {where}, "
                             f"got {ref.dtype} {ref.shape} on {_device_label(ref.device)}")
        self.counter = counter
        self.host = _cpu.view(ref) if ref.device[0] == "cpu" else None
        # a plan without tensors launches nothing: its step count is not read
        self.unread = plan._cuda is None and self.host is None
        launched = plan._cuda is not None and plan._cuda.count_steps(
            ref.ptr, plan._stream_for(ref.device[1], plan._stream))
        self.alone = None if launched else Plan(AddSpec(), {"tensors": [counter]},
                                                stream=plan._stream)

    def hyper(self, hyper: dict) -> dict | None:
        """The step's hyperparameters, with the step the counter gives; None where the counter,
        read on the host, holds no step count (a whole number >= 0), as a kernel would find."""
        step = hyper.get("step", self.counter)
        if step is not self.counter:
            raise ValueError("step: this plan counts its steps in the array given to "
                             "count_steps; pass no step= (or that array)")
        if self.unread:
            return dict(hyper, step=1.0)
        if self.host is not None:
            step = float(self.host[0]) + 1.0
            return dict(hyper, step=step) if STEP.holds(step) else None
        return hyper if "step" in hyper else dict(hyper, step=self.counter)
