"""The kernels, tables, workspaces and argument words of a plan on its GPUs."""
from __future__ import annotations

import contextlib
import functools

import numpy as np

from . import _source, _tables
from ._blocks import first_blocks, group_tensors
from ._launch import KernelLaunch
from ._row_tables import RowTables
from ._rows import Rows


class Launcher:
    """The kernels, tables, workspaces and argument words of a plan's groups on one GPU.

    Its device memory is kept (`_tables.Keeper`) until the launches queued on its latest
    stream have run: launches on a new stream wait for the previous stream's (through the
    tables, `MemcpyTable.before_launch`), so the latest stream's work is the last to use it."""

    def __init__(self, spec, arrays, dtypes, numels, pointers, table_mode, device_id, stream,
                 means: int = 0, sum_dtype=None):
        self.table_mode, self.device_id, self.pointers = table_mode, device_id, pointers
        self.groups = group_tensors([("cuda", device_id)] * len(numels), dtypes, numels, pointers,
                                    spec.chunk_for)
        _tables.collect(stream)
        self._keep = _tables.Keeper(device_id)
        self._keep.stream = stream  # the copies below are queued there: kept past them
        self.launches, self.tables, self._memory = [], [], self._keep.memory
        self.fused: list = []  # per group, its fused launch (both passes in one) or None
        self._tickets = 0  # the count of a fused launch's jobs taken (walker.cuh, walk_fused)
        self._rows = RowTables(spec, device_id)
        self.all_sums = None
        self.totals = None  # the address of the whole-list sums (see `_attach_sums`)
        # (a plan over several GPUs gives each the dtype of all its tensors')
        self.sum_dtype = sum_dtype or spec.sum_dtype(d[0] for d in dtypes)
        self._counters: list = []  # (memory, bytes) of the counts a kernel leaves at zero
        self._interrupted = False  # a step's launches stopped part way: counts may be left
        for group in self.groups:
            functors = spec.functors_for(group.dtypes)
            threads = spec.threads_for(group.dtypes, group.numels, _sms(device_id))
            source = spec.source(group.dtypes, threads, self.sum_dtype)
            # (a fused grid is twice the blocks; its arrival counts keep bit 31 for a flag)
            group.fused = spec.fusable(group.dtypes) and 2 * group.n_blocks < 2**30
            functions = _source.kernel_functions(source, device_id, len(functors),
                                                 spec.compile_options(group.dtypes), group.fused)
            self.launches.append([KernelLaunch(f, threads, group.n_blocks, spec.arg_fields)
                                  for f in functions[:len(functors)]])
            self.fused.append(KernelLaunch(functions[-1], threads, 2 * group.n_blocks,
                                           spec.arg_fields) if group.fused else None)
            self.tables.append(None)
        # groups whose rows read scheduled values from float32 slots (see RowTables)
        self._slotted = [_source.math_type(group.dtypes) == "float" for group in self.groups]
        with _cupy_device(device_id):
            if spec.n_sums:
                self._attach_sums(spec.n_sums, spec.n_totals, numels, stream)
            self._attach_arrays(arrays, stream)
            if "means_array" in spec.arg_fields:
                self._attach_means(means, stream)
                self._attach_vector_jobs(spec, arrays["shape_array"], stream)
            self.invalid = _device_copy(np.zeros(1, np.float32), stream)  # see Plan.invalid
        self._memory.append(self.invalid)
        for k in range(len(self.groups)):
            for launch in self._group_launches(k):
                launch.set_invalid(self.invalid.ptr)
        self.upload(stream)

    def _group_launches(self, k: int) -> list:
        """Group k's launches: one per pass, then its fused one, if any."""
        return self.launches[k] + ([self.fused[k]] if self.fused[k] is not None else [])

    def _runs_fused(self, busy: list) -> bool:
        """Whether a step that may runs each busy group's fused launch rather than its passes:
        where every busy group has one."""
        return bool(busy) and all(self.fused[k] is not None for k in busy)

    def __reduce_ex__(self, protocol):
        raise _tables._not_copied(self)

    def invalid_flags(self):
        import cupy

        return cupy.ndarray((1,), cupy.float32, self.invalid)

    def clear_invalid(self, stream_of) -> None:
        import cupy

        stream = stream_of(self.device_id)
        with _cupy_device(self.device_id):
            self._follow(stream)  # after the steps that may set it, before the next ones
            cupy.cuda.runtime.memsetAsync(self.invalid.ptr, 0, 4, stream)

    def _zero_counters(self, stream: int) -> None:
        """The counts that a step's launches leave at zero (arrivals, finished tensors, step
        arrivals), zeroed again: launches of a pass that stopped part way (an error, an
        interrupt) may have left them counting."""
        for memory, nbytes in self._counters:
            _tables._runtime().memsetAsync(memory.ptr, 0, nbytes, stream)
        self._interrupted = False

    def _follow(self, stream: int) -> None:
        """Work about to be queued on `stream` (not a launch) joins the plan's chain: after
        its latest work, and before the next launches (which wait for the tables' stream)."""
        for table in self.tables:
            table.before_launch(stream)
        self._keep.stream = stream

    def _attach_sums(self, n_sums: int, n_totals: int, numels: np.ndarray, stream: int) -> None:
        """The sums workspace: per group, block partials, arrival counts and a slice of the
        plan's sums (groups one after another), which `positions` maps to the caller's order;
        after them the `n_totals` whole-list sums (a rule's `totals`, its `totals_array`)."""
        import cupy

        offsets = np.cumsum([0] + [len(g.numels) for g in self.groups])
        positions = np.empty(len(numels), np.int32)
        for group, offset in zip(self.groups, offsets):
            positions[group.indices] = offset + np.arange(len(group.numels))
        positions *= n_sums
        size = np.dtype(self.sum_dtype).itemsize
        all_sums = _device_copy(np.zeros(max(len(numels) * n_sums + n_totals, 1), self.sum_dtype),
                                stream)
        mapping = _device_copy(positions if len(positions) else np.zeros(1, np.int32), stream)
        finished = _device_copy(np.zeros(1, np.uint32), stream)
        self._memory += [all_sums, mapping, finished]
        self._counters.append((finished, 4))
        self.all_sums = all_sums
        if n_totals:
            self.totals = all_sums.ptr + size * n_sums * len(numels)
        plan_sums = (all_sums.ptr, mapping.ptr, finished.ptr, len(numels), int(np.count_nonzero(numels)))
        if any(launch is not None for launch in self.fused):
            tickets = _device_copy(np.zeros(1, np.uint32), stream)  # (one launch at a time)
            self._memory.append(tickets)
            self._counters.append((tickets, 4))
            self._tickets = tickets.ptr
        for k, (group, offset) in enumerate(zip(self.groups, offsets)):
            partials = cupy.cuda.alloc(max(group.n_blocks * n_sums, 1) * size)
            arrivals = _device_copy(np.zeros(max(len(group.numels), 1), np.uint32), stream)
            self._memory += [partials, arrivals]
            self._counters.append((arrivals, 4 * max(len(group.numels), 1)))
            for launch in self._group_launches(k):
                launch.set_workspace(partials.ptr, arrivals.ptr,
                                     all_sums.ptr + size * n_sums * int(offset), plan_sums)
                if n_totals:
                    launch.set_array("totals_array", self.totals)

    def _attach_means(self, n: int, stream: int) -> None:
        """The workspace of a factored rule's per-matrix means and its factor pass's partial
        sums (kernels/factored.cuh): n doubles for the whole list (each tensor's offset is in
        its shape words)."""
        memory = _device_copy(np.zeros(max(n, 1), np.float64), stream)
        self._memory.append(memory)
        for k in range(len(self.groups)):
            for launch in self._group_launches(k):
                launch.set_array("means_array", memory.ptr)

    def _attach_vector_jobs(self, spec, words, stream: int) -> None:
        """The blocks with work of a factored rule's combine and matrix passes, which launch
        over those alone (`RuleSpec.vector_passes`): per tensor, its first few chunks."""
        passes = spec.vector_passes()
        if not passes:
            return
        for k, group in enumerate(self.groups):
            busy = spec.vector_blocks(np.asarray(words)[group.indices], group.chunk,
                                      self.launches[k][passes[0]].threads)
            jobs = first_blocks(group.numels, group.chunk, busy)
            if not len(jobs):  # no factored tensor: one block, which returns
                jobs = np.zeros(1, np.int32)
            memory = _device_copy(jobs, stream)
            self._memory.append(memory)
            for p in passes:
                self.launches[k][p].set_jobs(memory.ptr, len(jobs))

    def _attach_arrays(self, arrays: dict, stream: int) -> None:
        """Each per-tensor array (`*_array` kernel arguments), cut to each group's tensors."""
        for name, values in arrays.items():
            for k, group in enumerate(self.groups):
                memory = _device_copy(np.ascontiguousarray(np.asarray(values)[group.indices]), stream)
                self._memory.append(memory)
                for launch in self._group_launches(k):
                    launch.set_array(name, memory.ptr)

    def upload(self, stream: int) -> None:
        import cupy

        with cupy.cuda.Device(self.device_id):
            for k, group in enumerate(self.groups):
                table = group.table()
                if self.tables[k] is None or self.tables[k].nbytes != table.nbytes:
                    self.tables[k] = _tables.make_table(self.table_mode, table.nbytes, self.device_id)
                self.tables[k].write(table, stream)
                base = self.tables[k].ptr
                for launch in self._group_launches(k):
                    launch.set_table(base, base + group.records_offset)
                if self.fused[k] is not None:
                    self.fused[k].set_fused(base + group.jobs_offset, self._tickets)

    def rebound(self, columns: dict, stream_of) -> "Launcher":
        """Points slots at new addresses (slot index -> addresses); `stream_of(device_id)` is
        the launch stream. Raises, changing nothing, where the tables cannot be uploaded."""
        stream = stream_of(self.device_id)
        self.check_upload(stream)
        pointers = self.pointers.copy()
        for slot_index, addresses in columns.items():
            pointers[:, slot_index] = addresses
        self.pointers = pointers
        for group in self.groups:
            group.pointers = pointers[group.indices]
        self.upload(stream)
        self._keep.stream = stream
        return self

    def check_upload(self, stream: int) -> None:
        if _tables._capturing(stream):
            raise RuntimeError("mtapply cannot upload a pointer table while the stream is being "
                               "captured into a CUDA graph: rebind before capturing, and keep "
                               "the same tensors while the graph is in use")

    def _busy(self) -> list:
        """The groups with blocks to launch."""
        return [k for k, passes in enumerate(self.launches) if passes[0].n_blocks]

    @property
    def n_passes(self) -> int:
        """The passes of a step (launches one after another over every group)."""
        return len(self.launches[0]) if self.launches else 0

    def slotted_names(self, rows: Rows) -> tuple:
        """The names whose new values reach every launch of `rows` (the latest step's) by the
        slots alone: the slots' names, where every busy group reads them there."""
        if rows is None or rows.origin is not self._rows.slots._origin or not all(
                self._slotted[k] for k in self._busy()):
            return ()
        return self._rows.slots.names

    def write_slots(self, rows: Rows, stream: int) -> None:
        """The slots hold `rows`, which differ from the latest step's in slotted names only."""
        self._rows.slots.hold(rows, self._rows.scheduled, stream)

    def count_steps(self, counter_ptr: int, stream: int) -> bool:
        """Makes every launch take its step from the counter, and the blocks of the last pass
        advance it; False where nothing would launch (then the caller advances it)."""
        busy = self._busy()
        blocks = sum(self.groups[k].n_blocks for k in busy)
        if not blocks:
            return False
        with _cupy_device(self.device_id):
            arrivals = _device_copy(np.zeros(1, np.uint32), stream)
            self._follow(stream)
        self._memory.append(arrivals)
        self._counters.append((arrivals, 4))
        last = self.n_passes - 1
        for k in busy:
            for p, launch in enumerate(self.launches[k]):
                launch.set_counting(counter_ptr, arrivals.ptr, blocks if p == last else 0)
            if self.fused[k] is not None:  # (a step runs these or the passes: `_runs_fused`)
                self.fused[k].set_counting(counter_ptr, arrivals.ptr, 2 * blocks)
        return True

    def launch_order(self) -> list:
        """The launches of a step without hooks or rows, in `run`'s order."""
        busy = self._busy()
        if self._runs_fused(busy):
            return [self.fused[k] for k in busy]
        return [self.launches[k][p] for p in range(self.n_passes) for k in busy]

    def run(self, args: dict, stream_of, grad_scale=1.0, found_inf=None, after_pass=None,
            rows=None) -> None:
        """Every pass over every group, pass by pass: a pass may need all groups' sums (a
        global norm) from the one before. `stream_of(device_id)` is the launch stream;
        `after_pass(k)` runs on the host between passes k and k + 1; `rows` (mtapply._rows.Rows)
        gives per-tensor hyperparameters."""
        for p in self.passes(args, stream_of, grad_scale, found_inf, rows,
                             fused=after_pass is None):
            if after_pass is not None:
                after_pass(p)

    def passes(self, args: dict, stream_of, grad_scale=1.0, found_inf=None, rows=None,
               fused=True):
        """`run`'s launches, as a generator yielding k between passes k and k + 1 (once pass
        k's launches are queued), so that the caller may queue other work there; `fused`:
        whether a step may run each group's fused launch in place of its passes (then nothing
        is yielded). What may refuse the step (its rows) is done in this call, before any
        launch: a plan over several GPUs prepares every device's before it launches."""
        stream = stream_of(self.device_id)
        with _on(self.device_id):
            busy = self._busy()
            self._rows.prepare(rows, stream)
            for k in busy:
                self.tables[k].before_launch(stream)
                self._rows.place(k, self._group_launches(k), self.groups[k].indices, rows,
                                 stream, self._slotted[k])
            if self._interrupted:  # (after the wait for the interrupted launches' stream)
                self._zero_counters(stream)
        # every pass and yield comes even with nothing to launch here: ranks that all-reduce
        # between passes must all reach the hook
        passes = ([[self.fused[k] for k in busy]] if fused and self._runs_fused(busy) else
                  [[self.launches[k][p] for k in busy] for p in range(self.n_passes)])
        return self._launching(passes, busy, args, grad_scale, found_inf, stream)

    def _launching(self, passes: list, busy: list, args: dict, grad_scale, found_inf,
                   stream: int):
        for p, launches in enumerate(passes):
            with _on(self.device_id):
                self._interrupted = True  # until the pass's launches are all queued
                for launch in launches:
                    launch.set_args(args, grad_scale, found_inf)
                    launch.launch(stream)
                self._interrupted = False
            if p + 1 < len(passes):
                yield p
        with _on(self.device_id):  # (events recorded on the device's stream)
            for k in busy:
                self.tables[k].launched_on(stream)
                self._rows.launched_on(k, stream)
        self._keep.stream = stream

    @property
    def launches_anything(self) -> bool:
        return bool(self._busy())


@functools.lru_cache(maxsize=None)
def _sms(device_id: int) -> int:
    """The SMs of GPU `device_id`."""
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


def _cupy_device(device_id: int):
    import cupy

    return cupy.cuda.Device(device_id)


@contextlib.contextmanager
def _on(device_id: int):
    """CuPy's current device is `device_id` inside (switched only where it is not)."""
    import cupy

    if cupy.cuda.runtime.getDevice() == device_id:
        yield
    else:
        with cupy.cuda.Device(device_id):
            yield


def _device_copy(values: np.ndarray, stream: int):
    """Device memory holding `values`, copied on `stream` (ordered before the launches).

    From pageable memory the copy returns once `values` has been staged, so it may be freed.
    """
    import cupy

    memory = cupy.cuda.alloc(values.nbytes)
    cupy.cuda.runtime.memcpyAsync(memory.ptr, values.ctypes.data, values.nbytes, 1, stream)
    return memory





def launcher_for(spec, refs, arrays, table_mode, device_id, stream, sum_dtype=None) -> Launcher:
    """The launcher of ingested tensors on one GPU."""
    slots = spec.slots
    n = len(refs[slots[0]])
    dtypes = [tuple(refs[s][i].dtype for s in slots) for i in range(n)]
    numels = np.fromiter((r.numel for r in refs[slots[0]]), dtype=np.int64, count=n)
    pointers = np.array([[refs[s][i].ptr for s in slots] for i in range(n)], dtype=np.uint64)
    arrays, means = with_shapes(spec, refs, arrays)
    return Launcher(spec, arrays, dtypes, numels, pointers, table_mode, device_id, stream, means,
                    sum_dtype)


def with_shapes(spec, refs, arrays: dict) -> tuple:
    """(arrays, means): for a factored rule, `arrays` with its tensors' shapes (`shape_array`)
    and the size of its means' workspace; for other ops `arrays` as they are and 0. `refs`:
    slot -> per tensor an object with `shape` and `numel`."""
    shapes = getattr(spec, "shape_words", lambda refs: None)(refs)
    if shapes is None:
        return arrays, 0
    return {**arrays, "shape_array": shapes[0]}, shapes[1]
