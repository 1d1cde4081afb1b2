"""Kernel launches of a compiled XLA GPU program, read from its optimized HLO text (no GPU, no profiler).

After XLA's GPU pipeline every instruction of the entry computation that is not pure bookkeeping (parameter,
constant, tuple, get-tuple-element, bitcast) becomes one thunk that launches one kernel: a fusion (XLA's own
kernel, or a cuBLAS / Triton GEMM for `kCustom` fusions), a custom call (a Pallas Triton or Mosaic GPU kernel,
cuBLAS), a copy, an unfused dynamic-update-slice. A `while` runs its body once per trip (XLA writes the trip count
it proved into the instruction's backend_config, e.g. a `lax.scan` over N steps), a `call` / `conditional` runs
the computations it names. So the launches per program are the sum over that call tree. This is what
`bench/bench_step.py`'s profiler census counts on the device (the demo's plain step: 147 here, 147.6 per step in
the H200 trace of 2026-12-02), but it needs only a compile: `bench/census_offline.py` compiles the step for an
H200 target on a machine without one.

    census = count_launches(compiled.as_text())
    census.total, census.by_kind.most_common(10), census.sequence[:20]
"""

from __future__ import annotations

import collections
import dataclasses
import re

# instructions that launch nothing: buffer bookkeeping resolved at compile time
NO_LAUNCH = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
                       "replica-id", "opt-barrier", "add-dependency"})
CONTROL = frozenset({"while", "call", "conditional"})


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: its kind (`fusion:kLoop:loop_add_fusion`, `custom:<target>:<kernel name>`, `copy`),
    the instruction's name and the jax op it came from (metadata op_name, jit(...) prefix dropped)."""
    kind: str
    name: str
    op_name: str
    # the op_name is the instruction's own metadata (False: an XLA-made fusion without one, named by its last
    # inner op that has one, which may be an op of another part of the program)
    own_op_name: bool = True


@dataclasses.dataclass
class Census:
    launches: list[tuple[Launch, int]]  # (launch, times it runs per program call), in program order

    @property
    def total(self) -> int:
        return sum(n for _, n in self.launches)

    @property
    def by_kind(self) -> collections.Counter:
        c = collections.Counter()
        for launch, n in self.launches:
            c[launch.kind] += n
        return c

    def scopes(self, scopes: tuple[str, ...]) -> list[str]:
        """Each launch's named scope (jax.named_scope), in program order: the first component of its op_name path
        that starts with one of `scopes`, "other" where none does. A launch without op_name metadata of its own
        (XLA-made: e.g. the pieces of a scatter it rewrote) takes the scope of the next launch that has one (its
        consumer, as a rule), else of the previous one."""
        own = [scope(l, scopes) if l.own_op_name else None for l, _ in self.launches]
        out, later = list(own), None
        for i in range(len(own) - 1, -1, -1):
            later = own[i] if own[i] is not None else later
            out[i] = own[i] if own[i] is not None else later
        earlier = "other"
        for i, s in enumerate(out):
            earlier = out[i] = s if s is not None else earlier
        return out

    def by_scope(self, scopes: tuple[str, ...]) -> collections.Counter:
        """Launches by their named scope (`scopes`)."""
        c = collections.Counter()
        for (_, n), s in zip(self.launches, self.scopes(scopes)):
            c[s] += n
        return c

    def by_group(self) -> collections.Counter:
        """Launches by a coarse group: the Pallas kernel's name, or the fusion kind without its number."""
        c = collections.Counter()
        for launch, n in self.launches:
            c[group(launch)] += n
        return c


def group(launch: Launch) -> str:
    kind = launch.kind
    if kind.startswith("custom:"):
        return "pallas:" + (kind.rsplit(":", 1)[1] or "?")
    return kind


def scope(launch: Launch, scopes: tuple[str, ...]) -> str:
    """The component of the launch's op_name path (`jit(f)/while/body/draft_forward/dot_general`) that starts with
    one of `scopes`, outermost first; "other" where none does."""
    for part in launch.op_name.split("/"):
        if part.startswith(scopes):
            return part
    return "other"


def parse_computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines}, and the entry computation's name."""
    comps, entry, cur = {}, None, None
    for line in hlo.splitlines():
        if not line.startswith((" ", "\t")) and line.rstrip().endswith("{"):
            m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s", line)
            if m:
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
            continue
        if line.startswith("}"):
            cur = None
        elif cur is not None and line.strip():
            comps[cur].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return comps, entry


def opcode(line: str) -> str | None:
    """The opcode of one instruction line `%name = TYPE opcode(operands), attributes` (TYPE may be a tuple)."""
    i = line.find(" = ")
    if i < 0:
        return None
    j = i + 3
    if line[j:j + 1] == "(":  # a tuple type: skip its balanced parentheses
        depth = 0
        while j < len(line):
            depth += line[j] == "("
            depth -= line[j] == ")"
            j += 1
            if depth == 0:
                break
    else:
        while j < len(line) and line[j] != " ":
            j += 1
    m = re.match(r"\s*([a-z][a-z0-9\-]*)\(", line[j:])
    return m.group(1) if m else None


def _name(line: str) -> str:
    return re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line).group(1)


def _op_name(line: str) -> str:
    m = re.search(r'op_name="([^"]*)"', line)
    return re.sub(r"^jit\([^)]*\)/", "", m.group(1)) if m else ""


def _trip_count(line: str) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
    if m is None:
        raise ValueError(f"a while loop without a known trip count: {_name(line)} (its launches per call are "
                         "not a number)")
    return int(m.group(1))


def _called(line: str, key: str) -> list[str]:
    m = re.search(key + r"=\{([^}]*)\}", line) or re.search(key + r"=(%?[\w.\-]+)", line)
    return [c.strip().lstrip("%") for c in m.group(1).split(",")] if m else []


def _launch(line: str, op: str, comps) -> Launch:
    name = _name(line)
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', line).group(1)
        # a Pallas Triton kernel names itself in its backend config; a Mosaic GPU one in its op_name
        m = re.search(r'\bname = "(\w+)"', line) or re.search(r"/(\w+)/pallas_call", line)
        return Launch(f"custom:{target}:{m.group(1) if m else ''}", name, _op_name(line))
    if op == "fusion":
        kind = re.search(r"kind=(\w+)", line).group(1)
        body = _called(line, "calls")
        own = _op_name(line)
        inner = [_op_name(x) for x in comps.get(body[0], [])] if body and not own else []
        inner = [o for o in inner if o]
        return Launch(f"fusion:{kind}:{re.sub(r'[.0-9]+$', '', name)}", name, own or (inner[-1] if inner else ""),
                      bool(own))
    return Launch(op, name, _op_name(line))


def count_launches(hlo: str) -> Census:
    """The kernel launches of one call of the program whose optimized HLO text this is."""
    comps, entry = parse_computations(hlo)
    out: list[tuple[Launch, int]] = []

    def walk(comp: str, times: int, depth: int = 0):
        if depth > 64:
            raise ValueError("call tree deeper than 64: a recursive HLO?")
        for line in comps[comp]:
            op = opcode(line)
            if op is None or op in NO_LAUNCH:
                continue
            if op == "while":
                n = _trip_count(line)
                for c in _called(line, "condition"):
                    walk(c, times * (n + 1), depth + 1)  # the condition runs once more than the body
                for c in _called(line, "body"):
                    walk(c, times * n, depth + 1)
            elif op == "call":
                for c in _called(line, "to_apply"):
                    walk(c, times, depth + 1)
            elif op == "conditional":
                raise ValueError(f"conditional {_name(line)}: the launches depend on the branch taken")
            else:
                out.append((_launch(line, op, comps), times))

    walk(entry, 1)
    return Census(out)
