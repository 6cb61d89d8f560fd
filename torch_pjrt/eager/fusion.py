"""DEFER_AND_FUSE: ops are recorded, and run as one jitted program at the next sync point.

Recording reuses strict eager's per-op work entirely: the same cache entry (meta kernel
run, argument checks, the traceable per-op function) is looked up for each op, so errors
are raised at the op that caused them; a signature seen before is looked up and recorded by
the native dispatch (csrc/dispatch.cpp) without Python code per op. Instead of calling the op's program, its
function is appended to the pending graph and its results are `Deferred` placeholders.
At a sync point (a value read to the host, `torch.pjrt.synchronize()`, an op that must
run outside the graph, or the size cap) the pending graph runs as one program, cached by
its structure (which entries, wired how), never by data: traced scalars and random keys
are program inputs, so a training loop compiles once and then replays.
Each device has its own pending graph, whose program runs on that device (as CUDA queues each
device's work apart), so work on pjrt:0 and pjrt:1 fuses side by side; a value of one device's
graph read by another's (a cross-device copy) runs its graph first.
Only values still referenced by live tensors are program outputs; everything else dies
inside the program, and input buffers nothing else holds any more (a parameter or optimizer
state updated in place) are donated to it.
"""

from __future__ import annotations

import sys
import threading
import traceback
import weakref
from collections import Counter
from typing import Any

import numpy as np

from torch_pjrt import envvars, storage
from torch_pjrt.runtime import checks, client, disk_store, metrics, programs, spmd

MAX_NODES = int(envvars.value("TORCH_PJRT_FUSE_MAX_NODES"))
# A graph's float inputs, and its int inputs, at least this many of a kind, are passed packed in one host array of
# that kind (float64, int64): jax converts each Python number it is passed (~2-3 us) and checks each device array
# (~1 us), one host array ~6 us (Replay.arguments).
PACK_MIN = 8
# Replays a device's pending graph keeps (PendingGraph.replays): generate() on the tiny Llama meets 6 graphs in turn
# (bench/generate_tokens.py), a training step with an evaluation between its steps 2 or 3.
REPLAYS_KEPT = 8
DEBUG_RECOMPILE = envvars.flag("TORCH_PJRT_DEBUG_RECOMPILE")

flush_reasons: Counter = Counter()


class Deferred(storage.PendingArray):
    """One output of a recorded op; holds its array once the graph has run, or the error it failed with."""

    __slots__ = ("graph", "node", "index", "value", "failure", "__weakref__")

    def __init__(self, graph: PendingGraph, node: int, index: int) -> None:
        self.graph = graph
        self.node = node
        self.index = index
        self.value: Any = None
        self.failure: BaseException | None = None

    def resolve(self) -> Any:
        if self.value is None and self.failure is None:
            self.graph.flush("read")
        if self.failure is not None:
            raise RuntimeError(
                f"this pjrt tensor has no value: the fused program that should have computed it failed "
                f"({self.failure}); compute it again."
            ) from self.failure
        return self.value


class PendingGraph:
    """The ops recorded on one device since its last flush. Slotted: the native record path
    (csrc/dispatch.cpp) reads its members at their offsets, with no lookup by name per op."""

    __slots__ = ("device_index", "nodes", "inputs", "input_slots", "outputs", "where", "check_lines", "mesh",
                 "replay", "replays", "lock")

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self.nodes: list[tuple[Any, tuple[Any, ...]]] = []
        self.inputs: list[Any] = []
        self.input_slots: dict[int, int] = {}
        # Every recorded result in recording order, weakly: those still alive at the flush are outputs.
        self.outputs: list[weakref.ref[Deferred]] = []
        self.where: list[str] = []
        # the user line of each recorded op that makes device-side checks, in recording order
        self.check_lines: list[Any] = []
        # the mesh of a collective recorded (runtime/spmd.py): the program then runs on every rank of it
        self.mesh: Any = None
        # the last flush's program and what it was found by (a collective's included), for reports and benches
        self.replay: Replay | None = None
        # the last REPLAYS_KEPT flushes' distinct programs, most recently run first: a decode or training loop
        # flushes the same few graphs again and again (a generate()'s prefill, a decode graph per padded
        # length), each then told apart by list comparisons (_replayed), not a key's hash
        self.replays: list[Replay] = []
        self.lock = threading.RLock()

    def _ref(self, value: Any) -> Any:
        if isinstance(value, Deferred):
            if value.value is None and value.failure is None and value.graph is self:
                return ("n", value.node, value.index)
            value = value.resolve()
        if isinstance(value, (bool, int, float, complex)):
            self.inputs.append(value)
            return ("s", len(self.inputs) - 1, type(value))
        slot = self.input_slots.get(id(value))
        if slot is None:
            slot = self.input_slots[id(value)] = len(self.inputs)
            self.inputs.append(value)
        return ("c", slot)

    def record(self, entry: Any, inputs: list[Any], outputs: int) -> tuple[Deferred, ...]:
        """Append one op and return its results as placeholders. A signature the native dispatch has
        seen is recorded by csrc/dispatch.cpp instead, the same way: under `lock`, into these lists,
        with the same wiring refs; keep the two in step."""
        with self.lock:
            refs = tuple([self._ref(value) for value in inputs])
            node = len(self.nodes)
            self.nodes.append((entry, refs))
            if DEBUG_RECOMPILE:
                self.where.append(_user_line())
            if entry.checks:
                self.check_lines.append(checks.caller())
            results = tuple([Deferred(self, node, i) for i in range(outputs)])
            self.outputs.extend([weakref.ref(result) for result in results])
        if len(self.nodes) >= MAX_NODES:
            self.flush("size cap")
        return results

    def record_on_mesh(self, entry: Any, inputs: list[Any], outputs: int) -> tuple[Deferred, ...]:
        """Record a collective over `entry.mesh` as the last node of the graph's program, which every rank of
        the mesh runs, and dispatch that program (asynchronously: no value is read, nothing waits).

        One collective per program, at its end: ranks may cut their graphs at different points (a read on
        rank 0 alone), and jaxlib's CPU collectives pair up across programs only one collective per program
        (two collectives in one program against two programs on the peer timed out). The results are held
        while the program is built, so none is dropped as unread (a broadcast's root reads none, and its
        peers would wait for it)."""
        with self.lock:
            self.mesh = entry.mesh
            results = self.record(entry, inputs, outputs)
            self.flush("collective")
            return results

    def flush(self, reason: str) -> None:
        """Run everything recorded so far as one program and fill in the live results. A failed device-side
        check of a program that has already finished is raised here first (without waiting)."""
        with self.lock:
            if not self.nodes:
                return
            checks.raise_pending(wait=False)
            live = [deferred for ref in self.outputs if (deferred := ref()) is not None]
            nodes, inputs, where, check_lines = self.nodes, self.inputs, self.where, self.check_lines
            self.nodes, self.inputs, self.input_slots, self.where, self.check_lines = [], [], {}, [], []
            mesh, self.mesh = self.mesh, None
            self.outputs = []
            flush_reasons[reason] += 1
            metrics.bump("fused_programs")
            metrics.bump("fused_ops", len(nodes))
            wanted = tuple([(d.node, d.index) for d in live])
            donated = _unreferenced(inputs)
            metrics.bump("fused_donated_buffers", len(donated))
            try:
                replay = self._replayed(nodes, wanted, donated, mesh)
                if replay is not None:
                    metrics.bump("cache_hits")
                else:
                    count, numbers, packed = _traced_numbers(nodes, packing=mesh is None)
                    structure = (tuple([(id(entry), refs) for entry, refs in nodes]), wanted, donated,
                                 self.device_index, mesh, packed)
                    found = _programs.get(structure)
                    if found is None:  # (a stored program is compiled here, before its first call)
                        metrics.bump("fused_compiles")
                        if DEBUG_RECOMPILE:
                            _explain_recompile(nodes, where)
                        order = _output_order(nodes, wanted, donated)
                        found = _programs.put(structure, (_fused_program(nodes, wanted, order, donated,
                                                                         self.device_index, mesh, inputs, packed),
                                                          order))
                        _seen.append((nodes, where))
                    program, order = found
                    replay = self.replay = Replay(nodes, wanted, donated, mesh, program, order, self.device_index,
                                                  count, numbers, packed)
                    if mesh is None:  # (a collective's program is never replayed: Replay.matches)
                        self.replays = [replay, *self.replays[:REPLAYS_KEPT - 1]]
                arguments = inputs if mesh is not None else replay.arguments(inputs)  # (which may repack them)
                results = replay.program.call(*arguments)
            except BaseException as error:
                for deferred in live:
                    deferred.failure = error
                raise
            for position, value in zip(replay.order, results):
                live[position].value = value
            if check_lines:
                lines = tuple([line for line, count in zip(check_lines, replay.check_counts) for _ in range(count)])
                checks.issued(results[-1], replay.checks, lines)


    def _replayed(self, nodes: list[tuple[Any, tuple[Any, ...]]], wanted: tuple[tuple[int, int], ...],
                  donated: tuple[int, ...], mesh: Any) -> Replay | None:
        """The kept replay this graph is (the last one first), made the last one; None where none is: the graph is
        then looked up by its structure's key (~1.3 ms for a 192-op decode graph)."""
        for position, replay in enumerate(self.replays):
            if replay.matches(nodes, wanted, donated, mesh):
                if position:
                    self.replays.insert(0, self.replays.pop(position))
                self.replay = replay
                return replay
        return None


class Replay:
    """A flushed graph's program with what identifies its graph: the recorded nodes (entries and wiring),
    the outputs kept, the donated inputs and the mesh; the device-side checks its ops make, in order; and
    where its inputs hold traced numbers, with the device array each was last passed as, and those passed
    packed (`packed`: (dtype, input positions) for the graph's floats and for its ints, each where there are
    PACK_MIN or more)."""

    __slots__ = ("nodes", "wanted", "donated", "mesh", "program", "order", "checks", "check_counts", "device_index",
                 "numbers", "passed", "packed", "unpacked")

    def __init__(self, nodes: list[tuple[Any, tuple[Any, ...]]], wanted: tuple[tuple[int, int], ...],
                 donated: tuple[int, ...], mesh: Any, program: Any, order: tuple[int, ...], device_index: int,
                 input_count: int, numbers: tuple[int, ...], packed: Packs) -> None:
        # (held, not copied: the graph hands its list over at the flush and records into a new one)
        self.nodes = nodes
        self.wanted, self.donated, self.mesh, self.program = wanted, donated, mesh, program
        # the program returns the kept outputs in this order of `wanted`'s positions (_output_order)
        self.order = order
        self.device_index = device_index
        made = [entry.checks for entry, _ in nodes if entry.checks]
        self.checks = tuple(check for found in made for check in found)
        self.check_counts = tuple(len(found) for found in made)
        # the input positions of traced numbers passed one by one, and of those passed packed
        # (_traced_numbers): the same in every graph this one matches, so a replay converts those alone
        self.numbers, self.packed = numbers, packed
        self.passed: list[tuple[Any, Any]] = [(None, None)] * len(numbers)
        # the input positions passed one by one, where some are packed
        kept = {position for _, positions in packed for position in positions}
        self.unpacked = tuple([position for position in range(input_count) if position not in kept]) if packed else ()

    def matches(self, nodes: list[tuple[Any, tuple[Any, ...]]], wanted: tuple[tuple[int, int], ...],
                donated: tuple[int, ...], mesh: Any) -> bool:
        """Whether a graph is this one: the same entries (compared by identity first: the same entry object
        is the same op) wired the same way. The native dispatch appends this graph's own node where it
        records the same node at the same place, so a replayed graph compares node by node by identity."""
        return (mesh is None and self.mesh is None and wanted == self.wanted and donated == self.donated
                and nodes == self.nodes)

    def arguments(self, inputs: list[Any]) -> list[Any]:
        """The inputs with each traced number seen before as its device array (client.traced_number): jax
        converts a plain number on every call, and a decode step's program takes dozens (lengths, scales).
        A number equal to the one at its position in the last call (same type, nonzero) reuses the array
        passed then: a step's constants (AdamW's lr and betas, a model's scales) cost one comparison each.
        A value repeated within one call is looked up once: its second lookup would make it an array (a device
        transfer) as if it had come back in a later call (the GPT step's AdamW: 64 numbers, 9 values, two of
        them new every step). Numbers packed (`packed`) go in one host array of each kind after the other inputs
        (a decode step's positions and lengths, new every token: one int64 array, not a conversion each)."""
        passed = list(inputs)
        last = self.passed
        found: dict[tuple[type, Any], Any] = {}
        for slot, position in enumerate(self.numbers):
            value = inputs[position]
            kind = type(value)
            if kind not in _NUMBERS:  # (a subclass, numpy's float64: passed as it is)
                continue
            if value and kind is not complex:  # (0.0 and -0.0, or complex numbers' signed zeros, compare equal)
                before, array = last[slot]
                if type(before) is kind and before == value:
                    passed[position] = array
                    continue
                key = (kind, value)
                array = found.get(key)
                if array is None:
                    array = found[key] = client.traced_number(value, self.device_index)
                if type(array) is not kind:  # (a device array: a number met for the first time is passed as is)
                    last[slot] = (value, array)
                passed[position] = array
            else:
                passed[position] = client.traced_number(value, self.device_index)
        if self.packed:
            arguments = [passed[position] for position in self.unpacked]
            arguments += [np.array([inputs[position] for position in positions], dtype)
                          for dtype, positions in self.packed]
            return arguments
        return passed


# (dtype, input positions) of each kind of number a graph passes packed, floats first
Packs = tuple[tuple[Any, tuple[int, ...]], ...]


def _traced_numbers(nodes: list[tuple[Any, tuple[Any, ...]]], packing: bool) -> tuple[int, tuple[int, ...], Packs]:
    """One scan of a graph's wiring: how many inputs it reads (its "s" and "c" refs' positions), the input
    positions of the traced Python numbers (its ("s", position, type) refs) passed one by one, and those passed
    packed: where `packing` and this jax can make them weakly typed scalars again inside the program
    (client.weak_scalar_maker), its floats in one float64 array and its ints in one int64 array, each kind
    where it has PACK_MIN or more (bools and complex numbers one by one)."""
    count = 0
    kinds: dict[type, set[int]] = {float: set(), int: set()}
    others: set[int] = set()
    for _, refs in nodes:
        for ref in refs:
            if ref[0] == "n":
                continue
            position = ref[1]
            if position >= count:
                count = position + 1
            if ref[0] == "s":
                kinds.get(ref[2], others).add(position)
    packed = []
    for kind, dtype in ((float, np.float64), (int, np.int64)):
        if packing and len(kinds[kind]) >= PACK_MIN and client.weak_scalar_maker() is not None:
            packed.append((np.dtype(dtype), tuple(sorted(kinds[kind]))))
        else:
            others |= kinds[kind]
    return count, tuple(sorted(others)), tuple(packed)


_NUMBERS = (int, float, bool, complex)


def _output_order(nodes: list[tuple[Any, tuple[Any, ...]]], wanted: tuple[tuple[int, int], ...],
                  donated: tuple[int, ...]) -> tuple[int, ...]:
    """The order the program returns the kept outputs in (positions of `wanted`): first the last value written
    in place into each donated input (its in-place ops followed through their mutated arguments), in the donated
    inputs' order, then the others in recording order. jax pairs donated inputs with outputs of the same shape and
    dtype in order; recording order put a training step's gradients (the same shapes as the parameters, and
    written earlier) in the parameters' place, so XLA copied every parameter and optimizer state it was handed
    (93 copies in the GPT step's program)."""
    latest: dict[int, tuple[int, int]] = {}  # a donated input's position -> the last value written over it
    origins: dict[tuple[int, int], int] = {}  # a value written in place -> the input position it replaced
    for node, (entry, refs) in enumerate(nodes):
        mutated = getattr(entry, "mutated_slots", ())
        if not mutated:
            continue
        first = entry.output_count - len(mutated)
        for index, slot in enumerate(mutated):
            if slot not in entry.passed_slots:
                continue  # (overwritten whole, never read: uniform_ is not passed its storage)
            ref = refs[entry.passed_slots.index(slot)]
            origin = ref[1] if ref[0] == "c" else origins.get((ref[1], ref[2])) if ref[0] == "n" else None
            if origin is not None:
                latest[origin] = (node, first + index)
                origins[(node, first + index)] = origin
    position_of = {output: position for position, output in enumerate(wanted)}
    first_positions = [position_of[latest[input_position]] for input_position in donated
                       if latest.get(input_position) in position_of]
    taken = set(first_positions)
    return tuple(first_positions + [position for position in range(len(wanted)) if position not in taken])


def _unreferenced(inputs: list[Any]) -> tuple[int, ...]:
    """Positions of the device arrays that only this list holds: no storage, tensor, pending
    result or user keeps them, so the program may reuse their buffers (the in-place updates)."""
    array = client.array_type()
    # (counted inline as compile/backend.py's _donated is: a helper's frame can hold one more reference)
    held_here = 2  # the list's reference and getrefcount's argument
    return tuple([
        index for index in range(len(inputs))
        if type(inputs[index]) is array and sys.getrefcount(inputs[index]) == held_here
    ])


def _fused_program(
    nodes: list[tuple[Any, tuple[Any, ...]]], wanted: tuple[tuple[int, int], ...], order: tuple[int, ...],
    donated: tuple[int, ...], device_index: int, mesh: Any, inputs: list[Any], packed: Packs = (),
) -> Any:
    """The program of a pending graph: stored for later processes (and loaded from an earlier one's store)
    where the cache folder is on and every op's entry has a process-independent structure. With `packed`
    float input positions, it takes the other inputs one by one and those as one host array, last. It returns
    the kept outputs in `order` (positions of `wanted`: _output_order), then the device-side checks' code."""
    functions = [entry.fn for entry, _ in nodes]
    wiring = [refs for _, refs in nodes]
    ordered = [wanted[position] for position in order]
    # ops with device-side checks: their programs' last output is a code; the graph returns one for all
    checked = [node for node, (entry, _) in enumerate(nodes) if entry.checks]
    offsets = [0]
    for node in checked[:-1]:
        offsets.append(offsets[-1] + len(nodes[node][0].checks))

    def fused(*inputs: Any) -> tuple[Any, ...]:
        metrics.bump("fused_traces")  # (this runs only while jax traces the program)
        values: list[Any] = []
        for fn, refs in zip(functions, wiring):
            args = [values[r[1]][r[2]] if r[0] == "n" else inputs[r[1]] for r in refs]
            values.append(fn(*args))
        results = tuple(values[node][index] for node, index in ordered)
        if checked:
            results += (checks.combine([values[node][-1] for node in checked], offsets),)
        return results

    if mesh is not None:
        return spmd.MeshProgram(fused, mesh, f"fused[{len(nodes)}]", donate=donated)
    name = f"fused[{len(nodes)}]"
    arguments = list(inputs)
    if packed:
        fused, arguments, donated = _packed_program(fused, inputs, packed, donated)
    stored = _stored_key(nodes, wanted, donated, arguments, packed) if disk_store.enabled() else None
    if stored is not None:
        return programs.stored_executable(fused, tuple(arguments), stored, name, donate=donated,
                                          device_index=device_index)
    # placed on its device: a graph of factories alone has no input that would place it
    return programs.Program(fused, name, donate=donated, device_index=device_index)


def _packed_program(fused: Any, inputs: list[Any], packed: Packs, donated: tuple[int, ...],
                    ) -> tuple[Any, list[Any], tuple[int, ...]]:
    """`fused` taking the inputs packed (`packed`: floats, ints) as one host array of each kind after the
    others: each element unpacked as the weakly typed scalar jax makes of a Python number, so it promotes as one
    (a float32 tensor times a float stays float32, an int32 one plus an int stays int32). With the example
    arguments and the donated inputs' argument positions."""
    weak_scalar = client.weak_scalar_maker()
    count = len(inputs)
    packed_set = {position for _, positions in packed for position in positions}
    unpacked = [position for position in range(count) if position not in packed_set]

    def program(*arguments: Any) -> tuple[Any, ...]:
        values: list[Any] = [None] * count
        for argument, position in zip(arguments, unpacked):
            values[position] = argument
        for pack, (_, positions) in zip(arguments[len(unpacked):], packed):
            for index, position in enumerate(positions):
                values[position] = weak_scalar(pack[index], pack.dtype)
        return fused(*values)

    argument_of = {position: index for index, position in enumerate(unpacked)}
    example = [inputs[position] for position in unpacked]
    example += [np.array([inputs[position] for position in positions], dtype) for dtype, positions in packed]
    return program, example, tuple(argument_of[position] for position in donated)


def _stored_key(nodes: list[tuple[Any, tuple[Any, ...]]], wanted: tuple[tuple[int, int], ...],
                donated: tuple[int, ...], inputs: list[Any], packed: Packs = ()) -> str | None:
    """What a pending graph's program depends on, the same in every process: our code and the versions,
    each op's structure (overload, views, static arguments, default dtype, matmul precision, kernel
    fingerprint), the wiring, the outputs kept, the donated inputs, the packed number inputs and each
    argument's type; None when an op's structure is known only in this process."""
    digest = disk_store.entry_digest()
    digest.update(f"{wanted!r}\0{donated!r}\0{packed!r}\n".encode())
    for entry, refs in nodes:
        structure = getattr(entry, "structure", None)
        if structure is None:
            return None
        digest.update(f"{structure}\0{refs!r}\n".encode())
    for value in inputs:
        shape = getattr(value, "shape", None)
        described = type(value).__name__ if shape is None else (tuple(shape), str(value.dtype),
                                                                getattr(value, "weak_type", False))
        digest.update(repr(described).encode())
    return digest.hexdigest()


_programs = programs.ProgramCache()
_seen: list[tuple[list[Any], list[str]]] = []
# One pending graph per device, for every thread: autograd runs backward ops on its own device
# threads, and forward, backward and optimizer ops of a step belong in one program.
_graphs: dict[int, PendingGraph] = {}
_graphs_lock = threading.Lock()


def graph(device_index: int = 0) -> PendingGraph:
    """pjrt:device_index's pending graph (made on first use)."""
    found = _graphs.get(device_index)
    if found is None:
        with _graphs_lock:
            found = _graphs.setdefault(device_index, PendingGraph(device_index))
    return found


def graphs() -> dict[int, PendingGraph]:
    """The live table of pending graphs by device index (the native dispatch reads it directly)."""
    return _graphs


def pending() -> bool:
    """Whether any device has recorded ops not yet run."""
    return any(found.nodes for found in list(_graphs.values()))


def flush(reason: str) -> None:
    """Run every device's pending graph."""
    for found in list(_graphs.values()):
        found.flush(reason)


def concrete(value: Any) -> Any:
    return value.resolve() if isinstance(value, Deferred) else value


def _user_line() -> str:
    for frame in reversed(traceback.extract_stack(limit=40)):
        if "torch_pjrt" not in frame.filename and "/torch/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}: {frame.line}"
    return "<unknown>"


def _explain_recompile(nodes: list[tuple[Any, tuple[Any, ...]]], where: list[str]) -> None:
    """For a new program that looks like an earlier one, print the first op that differs and its user line."""
    for old_nodes, _ in reversed(_seen[-20:]):
        if abs(len(old_nodes) - len(nodes)) > max(4, len(nodes) // 10):
            continue
        for position, ((entry, refs), (old_entry, old_refs)) in enumerate(zip(nodes, old_nodes)):
            if entry is not old_entry or refs != old_refs:
                print(
                    f"torch_pjrt: recompiling a fused program of {len(nodes)} ops (previous: {len(old_nodes)}); "
                    f"op {position} differs: {entry.program.name} {_describe(entry)} vs {old_entry.program.name} "
                    f"{_describe(old_entry)}; user line: {where[position] if position < len(where) else '?'}"
                )
                return
        print(f"torch_pjrt: recompiling a fused program: {len(nodes)} ops vs {len(old_nodes)} before "
              f"(the pending graph was cut at a different point)")
        return


def _describe(entry: Any) -> str:
    return str(getattr(entry, "key_summary", ""))


def report() -> dict[str, Any]:
    programs_run = metrics.counters_now("fused_programs")
    return {
        "fused_programs": programs_run,
        "mean_ops_per_program": metrics.counters_now("fused_ops") / programs_run if programs_run else 0.0,
        "flush_reasons": dict(flush_reasons),
    }

