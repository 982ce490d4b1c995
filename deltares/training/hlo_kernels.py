"""The kernels of a compiled GPU program, read from its optimized HLO text.

XLA's GPU compiler turns a program into a sequence of kernels: each fusion, each custom call
(cuBLAS and cuDNN calls, Pallas kernels: "kernels of their own", `OWN_KERNELS`) and each unfused copy or transpose of the entry
computation is launched on its own; a `while` loop's body is launched once per iteration. For
each kernel this module counts the bytes it must move (its operands and its output, where a
fusion reads only a slice of an operand or writes a slice of its output in place, just that
slice) and the FLOPs of its matrix products, from the shapes the HLO states. Nothing runs:
`deltares.training.gpu_step_time` turns the kernels into a time.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

# bytes per element of the HLO element types
DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "f8e3m4": 1,
    "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0, "tuple": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^(ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
# free at run time: no kernel, no traffic (views, tuples, constants folded into kernels)
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id", "replica-id",
        "opt-barrier", "add-dependency", "domain", "get-dimension-size", "iota"}
SLICES = {"slice", "dynamic-slice", "gather"}
# The custom calls of Pallas kernels on GPUs, by the backend that wrote them: Triton, and Mosaic GPU
# (`mosaic_gpu_v2`; `mosaic_gpu` in older jax). Each is one launch, its bytes its operands and results (a
# result aliasing an operand, a cotangent accumulated in place, is read and written).
VIEWS = {"bitcast", "reshape"}  # the same elements under another shape
# Kernels of their own: custom calls that launch a kernel a Pallas backend compiled for the program (not one of
# XLA's fusions, not a cuBLAS or cuDNN call), priced with a bandwidth efficiency of their own
# (deltares.training.gpu_step_time). A piece of the custom call's target -> the backend's name; a backend is
# recognised by adding its target here.
OWN_KERNELS = {"xla.gpu.triton": "Triton", "mosaic_gpu": "Mosaic GPU"}  # "mosaic_gpu" matches mosaic_gpu_v2 too
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


@dataclass
class Instruction:
    name: str
    type: str  # the result type as written, e.g. "f32[8,256]{1,0}" or "(f32[2], s32[])"
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operands' closing parenthesis
    args: str = ""  # the text between the parentheses (a parameter's number)

    @property
    def bytes(self) -> float:
        return type_bytes(self.type)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None

    def backend_config(self) -> dict:
        m = re.search(r"backend_config=(\{.*\})", self.attrs)
        if not m:
            return {}
        text, depth = m.group(1), 0
        for i, ch in enumerate(text):  # the JSON object ends at its matching brace
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0:
                try:
                    return json.loads(text[: i + 1])
                except ValueError:
                    return {}
        return {}


@dataclass
class Kernel:
    """One launch: what it is, the bytes it moves and the FLOPs of its matrix products."""

    name: str
    what: str  # "fusion:kLoop", "gemm", "custom-call:__cudnn$fmhaSoftmax", "copy", ...
    bytes: float
    flops: float
    op_name: str = ""  # the jax operation it came from (HLO metadata op_name), for grouping
    f32: bool = False  # its matrix products take float32 operands (TF32 on the tensor cores)
    count: int = 1  # launches (a loop body's kernels run once per iteration)
    own: str = ""  # a kernel of its own: the backend that compiled it ("Triton"; OWN_KERNELS), else ""


@dataclass
class Module:
    computations: dict[str, list[Instruction]] = field(default_factory=dict)
    entry: str = ""

    def table(self, computation: str) -> dict[str, Instruction]:
        return {i.name: i for i in self.computations[computation]}


def own_kernel(target: str) -> str:
    """The backend of a custom call's target that launches a kernel of its own ("Triton"), "" for any other."""
    return next((name for piece, name in OWN_KERNELS.items() if piece in target), "")


def own_kernel_calls(hlo_text: str) -> int:
    """The custom calls of an HLO text that launch kernels of their own (each call once, loops not unrolled)."""
    return sum(bool(own_kernel(t)) for t in _TARGET.findall(hlo_text))


def type_bytes(type_text: str) -> float:
    """Bytes of an HLO type: an array `f32[8,256]{1,0}` or a tuple of arrays."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(type_text):
        size = DTYPE_BYTES.get(dtype)
        if size is None:
            continue
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def dims_of(type_text: str) -> list[int]:
    m = _ARRAY.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _split_operands(rest: str) -> tuple[str, str]:
    """(operand text, attribute text) of what follows `opcode(`."""
    depth = 1
    for i, ch in enumerate(rest):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                return rest[:i], rest[i + 1 :]
    return rest, ""


def parse_module(text: str) -> Module:
    """The computations of an HLO module's text (`compiled.as_text()`)."""
    module = Module()
    current: list[Instruction] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = module.computations.setdefault(m.group(2), [])
                if m.group(1):
                    module.entry = m.group(2)
            continue
        if line == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            args, attrs = _split_operands(m.group(5))
            operands = re.findall(r"%([\w.\-]+)", args)
            current.append(Instruction(m.group(2), m.group(3), m.group(4), operands, attrs, args))
    if not module.entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return module


# --------------------------------------------------------------------------- FLOPs


def dot_flops(dot: Instruction, table: dict[str, Instruction]) -> float:
    """2 x output elements x contracted size of a `dot` (its lhs's contracting dimensions)."""
    lhs = table.get(dot.operands[0]) if dot.operands else None
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", dot.attrs)
    if lhs is None or not m:
        return 0.0
    dims = dims_of(lhs.type)
    contracted = math.prod(dims[int(d)] for d in m.group(1).split(",") if d)
    return 2.0 * math.prod(dims_of(dot.type)) * contracted


def computation_dots(module: Module, name: str, seen: frozenset = frozenset()) -> list[tuple[float, str]]:
    """(FLOPs, lhs element type) of every matrix product of a fused computation, nested fusions included."""
    if name in seen or name not in module.computations:
        return []
    table = module.table(name)
    dots: list[tuple[float, str]] = []
    for ins in module.computations[name]:
        if ins.opcode == "dot":
            lhs = table.get(ins.operands[0]) if ins.operands else None
            dtype = _ARRAY.search(lhs.type).group(1) if lhs is not None and _ARRAY.search(lhs.type) else ""
            dots.append((dot_flops(ins, table), dtype))
        elif ins.opcode in ("fusion", "call"):
            inner = ins.attr("calls") or ins.attr("to_apply")
            if inner:
                dots += computation_dots(module, inner, seen | {name})
    return dots


def _gemm_custom_call_flops(ins: Instruction, table: dict[str, Instruction]) -> float:
    """FLOPs of a cuBLAS gemm custom call, from its backend config's dot dimensions."""
    config = ins.backend_config().get("gemm_backend_config", {})
    dims = config.get("dot_dimension_numbers", {})
    lhs = table.get(ins.operands[0]) if ins.operands else None
    if lhs is None:
        return 0.0
    lhs_dims = dims_of(lhs.type)
    contracted = math.prod(lhs_dims[int(d)] for d in dims.get("lhs_contracting_dimensions", []))
    out = ins.type
    if out.startswith("("):  # (result, workspace)
        out = out[1:]
    return 2.0 * math.prod(dims_of(out)) * contracted


def fused_attention_flops(batch_heads: int, T: int, S: int, D: int, *, backward: bool, causal: bool) -> float:
    """FLOPs of one fused (flash) attention call of `batch_heads` query heads over T queries and S keys of
    width D: 4 B H T S D forward (two products, Q K^T and P V), 2.5 times that backward (five: the scores
    again, dV, dP, dQ, dK), halved under a causal mask (the kernel skips the masked blocks)."""
    flops = 4.0 * batch_heads * T * S * D * (2.5 if backward else 1.0)
    return flops / 2 if causal else flops


def _attention_flops(ins: Instruction, table: dict[str, Instruction]) -> float:
    """FLOPs of a cuDNN fused attention call (`fused_attention_flops`), its shapes read from the HLO."""
    q = table.get(ins.operands[0]) if ins.operands else None
    k = table.get(ins.operands[1]) if len(ins.operands) > 1 else None
    if q is None or k is None:
        return 0.0
    qd, kd = dims_of(q.type), dims_of(k.type)
    if len(qd) != 4 or len(kd) != 4:
        return 0.0
    config = ins.backend_config().get("cudnn_fmha_backend_config", {})
    layout = config.get("bmm1_dot_dimension_numbers", {})
    batch = [int(d) for d in layout.get("lhs_batch_dimensions", [0, 2])]
    contract = [int(d) for d in layout.get("lhs_contracting_dimensions", [3])]
    free_q = [d for d in range(4) if d not in batch + contract]
    k_contract = [int(d) for d in layout.get("rhs_contracting_dimensions", [3])]
    k_batch = [int(d) for d in layout.get("rhs_batch_dimensions", [0, 2])]
    free_k = [d for d in range(4) if d not in k_batch + k_contract]
    B_H = math.prod(qd[d] for d in batch)
    T, D = math.prod(qd[d] for d in free_q), math.prod(qd[d] for d in contract)
    S = math.prod(kd[d] for d in free_k)
    return fused_attention_flops(B_H, T, S, D, backward="Backward" in ins.attrs.split('custom_call_target="')[-1].split('"')[0],
                                 causal=config.get("mask_type", "") in ("CAUSAL", "PADDING_CAUSAL"))


# --------------------------------------------------------------------------- bytes


def _root(module: Module, computation: str) -> Instruction | None:
    instrs = module.computations.get(computation, [])
    return instrs[-1] if instrs else None


def _in_place_write(module: Module, computation: str, out_bytes: float) -> float:
    """Bytes a fusion writes: its output, less what an in-place dynamic-update-slice root leaves unwritten."""
    root = _root(module, computation)
    if root is None:
        return out_bytes
    table = module.table(computation)
    roots = [table[o] for o in root.operands if o in table] if root.opcode == "tuple" else [root]
    written = out_bytes
    for r in roots:
        while r.opcode in VIEWS and r.operands and r.operands[0] in table:
            r = table[r.operands[0]]
        if r.opcode == "dynamic-update-slice" and len(r.operands) > 1 and r.operands[1] in table:
            written -= r.bytes - table[r.operands[1]].bytes
    return max(written, 0.0)


def kernel_of(module: Module, ins: Instruction, table: dict[str, Instruction]) -> Kernel | None:
    """The kernel an instruction of a sequential computation launches (None: free)."""
    if ins.opcode in FREE:
        return None
    operand_bytes = [table[o].bytes if o in table else 0.0 for o in ins.operands]
    distinct = [table[o].bytes if o in table else 0.0 for o in dict.fromkeys(ins.operands)]
    op_name = ""
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    if m:
        op_name = m.group(1)
    if ins.opcode == "fusion":
        called = ins.attr("calls") or ""
        kind = re.search(r"kind=(\w+)", ins.attrs)
        fusion_kind = ins.backend_config().get("fusion_backend_config", {}).get("kind") or (kind.group(1) if kind else "")
        reads = _fusion_param_reads(module, called)
        first = {o: i for i, o in reversed(list(enumerate(ins.operands)))}  # an operand passed twice is read once
        read = sum(b if (b := reads.get(i)) is not None else operand_bytes[i] for o, i in first.items())
        written = _in_place_write(module, called, ins.bytes)
        dots = computation_dots(module, called)
        flops = sum(f for f, _ in dots)
        what = "gemm" if flops else f"fusion:{fusion_kind}"
        return Kernel(ins.name, what, read + written, flops, op_name, f32=any(t == "f32" for _, t in dots))
    if ins.opcode == "custom-call":
        target = _TARGET.search(ins.attrs)
        target = target.group(1) if target else "?"
        flops = 0.0
        if "cublas" in target or "gemm" in target:
            flops = _gemm_custom_call_flops(ins, table)
        elif "fmha" in target or "cudnn" in target:
            flops = _attention_flops(ins, table)
        return Kernel(ins.name, f"custom-call:{target}", sum(distinct) + ins.bytes, flops, op_name,
                      own=own_kernel(target))
    if ins.opcode == "dynamic-update-slice":
        update = operand_bytes[1] if len(operand_bytes) > 1 else 0.0
        return Kernel(ins.name, ins.opcode, 2 * update, 0.0, op_name)
    if ins.opcode == "dot":
        lhs = table.get(ins.operands[0]) if ins.operands else None
        return Kernel(ins.name, "gemm", sum(operand_bytes) + ins.bytes, dot_flops(ins, table), op_name,
                      f32=lhs is not None and lhs.type.startswith("f32"))
    return Kernel(ins.name, ins.opcode, sum(distinct) + ins.bytes, 0.0, op_name)


def _fusion_param_reads(module: Module, computation: str) -> dict[int, float | None]:
    """{parameter index: bytes read, None for whole} of a fused computation. A parameter whose every
    use is a slice (through reshapes and bitcasts) is read only where sliced; one updated in place by
    a dynamic-update-slice is not read at all (the update is what is written)."""
    instrs = module.computations.get(computation, [])
    users: dict[str, list[Instruction]] = {}
    for ins in instrs:
        for op in dict.fromkeys(ins.operands):
            users.setdefault(op, []).append(ins)

    def slices(name: str, depth: int = 0) -> float | None:
        total = 0.0
        uses = users.get(name, [])
        if not uses or depth > 8:
            return None
        for u in uses:
            if u.opcode in SLICES and u.operands[0] == name:
                total += u.bytes
            elif u.opcode == "dynamic-update-slice" and u.operands[0] == name:
                continue
            elif u.opcode in VIEWS:
                inner = slices(u.name, depth + 1)
                if inner is None:
                    return None
                total += inner
            else:
                return None
        return total

    reads: dict[int, float | None] = {}
    order = 0
    for ins in instrs:
        if ins.opcode != "parameter":
            continue
        reads[_parameter_index(ins, order)] = slices(ins.name)
        order += 1
    return reads


def _parameter_index(ins: Instruction, default: int) -> int:
    """A parameter instruction's number (`parameter(3)`)."""
    m = re.match(r"\s*(\d+)", ins.args)
    return int(m.group(1)) if m else default


def kernels(module: Module, computation: str | None = None, times: int = 1) -> Iterator[Kernel]:
    """Every kernel launched running `computation` (default: the entry) once, loop bodies unrolled
    by their known trip counts (a loop of unknown count: once), a conditional's costliest branch."""
    name = computation or module.entry
    table = module.table(name)
    for ins in module.computations[name]:
        if ins.opcode == "while":
            trips = ins.backend_config().get("known_trip_count", {}).get("n")
            n = int(trips) if trips else 1
            body, cond = ins.attr("body"), ins.attr("condition")
            if body:
                yield from kernels(module, body, times * n)
            if cond:
                yield from kernels(module, cond, times * (n + 1))
        elif ins.opcode == "conditional":
            branches = re.findall(r"%([\w.\-]+)", (re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
                                                    or re.search(r"(true_computation=.*)", ins.attrs)).group(1))
            costs = [list(kernels(module, b, times)) for b in branches]
            if costs:
                yield from max(costs, key=lambda ks: sum(k.bytes * k.count for k in ks))
        elif ins.opcode in ("call", "async-start") and ins.attr("to_apply" if ins.opcode == "call" else "calls"):
            yield from kernels(module, ins.attr("to_apply" if ins.opcode == "call" else "calls"), times)
        else:
            k = kernel_of(module, ins, table)
            if k is not None:
                k.count = times
                yield k
