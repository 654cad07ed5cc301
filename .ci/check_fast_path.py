#!/usr/bin/env python3
"""Checks that `thiscpu::current_cpu()` compiles to a short fast path.

Builds the release example `fast_path_probe` (unless --binary is given), disassembles the
function `thiscpu_probe_current_cpu` with `objdump -d --no-show-raw-insn`, prints it, and
follows the code from the entry the way the processor does when rseq is registered:

  * prologue instructions at the entry (endbr64, push, frame set-up) are skipped and shown;
  * then every instruction up to the first conditional branch counts towards the fast path;
  * the branch has two sides: the fast side reaches `ret` without calling anything, the cold
    side calls or jumps out of the function (the slow path). Instructions on the fast side
    before `ret` (other than the epilogue) count towards the fast path too.

It fails when the fast path has more than --max-insns instructions besides the one branch,
when a call (or a jump out of the function) comes before the branch, when there is more than
one conditional branch on the fast path, or when the function cannot be found or parsed.
A fast path with no branch at all (straight to `ret`) is accepted under the same limit.

Then it disassembles `thiscpu_probe_counter_inc` (`Counter::inc()` alone) and finds the shortest
path from its entry to `ret` that calls nothing, whichever way each conditional branch goes:
the increment when rseq is registered. It fails when there is no such path, or when that path
holds an atomic read-modify-write (an x86 `lock` prefix or `xchg` with memory; an arm64
load/store-exclusive, LSE atomic or compare-and-swap; a riscv `amo*`, `lr` or `sc`): the point
of the restartable sequence is to need none.

Last it disassembles `thiscpu_probe_adder_loop` (increments through one `Counter::adder()`)
and finds its innermost loop that calls nothing (the smallest span from a backward branch's
target to the branch). It fails when there is none, when the loop holds an atomic
read-modify-write, or when more than --max-loop-reads instructions in it read memory: the
section reads `cpu_id` twice and the counter's word once, and everything the adder read when it
was made (where the rseq area is, the counter's address, the rows) must stay in registers.

Usage: check_fast_path.py [--binary PATH] [--symbol NAME] [--max-insns N]
                          [--lock-free-symbol NAME] [--adder-loop-symbol NAME]
                          [--max-loop-reads N]
"""

import argparse
import json
import os
import re
import subprocess
import sys

SYMBOL = "thiscpu_probe_current_cpu"
LOCK_FREE_SYMBOL = "thiscpu_probe_counter_inc"
ADDER_LOOP_SYMBOL = "thiscpu_probe_adder_loop"
# The CPU read before the section, the comparison inside it, and the load of the word.
MAX_LOOP_READS = 3
# x86_64: the own area's offset (a constant the linker substitutes), the delta word, the load of
# cpu_id and its sign test. aarch64 and riscv64 pass their own limits.
MAX_INSNS = 4

# objdump (AT&T syntax on x86_64) prints "  15ad0:\tmov    0x467a9(%rip),%rcx  # comment".
LINE = re.compile(r"^\s*([0-9a-f]+):\s+(.*?)\s*$")
X86_PREFIXES = {"bnd", "notrack", "rep", "repz", "repe", "repnz", "repne", "lock", "data16",
                "cs", "ds", "es", "ss", "addr32"}


class Insn:
    def __init__(self, address, mnemonic, operands, text):
        self.address = address
        self.mnemonic = mnemonic
        self.operands = operands
        self.text = text

    def __repr__(self):
        return f"{self.address:x}: {self.text}"


# riscv64 mnemonics as objdump prints them (with its aliases: `ret`, `j`, `jr`, `beqz`...).
RISCV_COND_BRANCHES = {"beq", "bne", "blt", "bge", "bltu", "bgeu", "beqz", "bnez", "bltz",
                       "bgez", "blez", "bgtz", "bgt", "ble", "bgtu", "bleu"}


class Arch:
    """Instruction classes for one architecture, by mnemonic."""

    def __init__(self, name):
        self.name = name

    def is_ret(self, insn):
        return insn.mnemonic in ("ret", "retq", "retaa", "retab")

    def is_call(self, insn):
        if self.name == "x86_64":
            return insn.mnemonic in ("call", "callq", "syscall", "int", "sysenter")
        if self.name == "riscv64":
            # `jal`/`jalr` without a link register of `zero` (those print as `j`/`jr`).
            return insn.mnemonic in ("jal", "jalr", "call", "ecall")
        return insn.mnemonic in ("bl", "blr", "blraa", "blrab", "svc")

    def is_jump(self, insn):
        if self.name == "x86_64":
            return insn.mnemonic in ("jmp", "jmpq")
        if self.name == "riscv64":
            return insn.mnemonic in ("j", "jr", "tail")
        return insn.mnemonic in ("b", "br", "braa", "brab")

    def is_atomic_rmw(self, insn):
        """An instruction that reads, modifies and writes memory atomically."""
        m = insn.mnemonic
        if self.name == "x86_64":
            locked = re.match(r"^(\S+\s+)*lock\b", insn.text) is not None
            return locked or (m.startswith("xchg") and "(" in insn.operands)
        if self.name == "riscv64":
            return re.match(r"^(amo|lr\.|sc\.|lr$|sc$)", m) is not None
        return re.match(r"^(ld[a]?xr|ld[a]?xp|st[l]?xr|st[l]?xp|cas|swp|ld(add|clr|eor|set|smax"
                        r"|smin|umax|umin)|st(add|clr|eor|set|smax|smin|umax|umin))", m) is not None

    def reads_memory(self, insn):
        """Whether the instruction loads from memory (a store alone does not count)."""
        m = insn.mnemonic
        if self.name == "x86_64":
            if m.startswith("lea") or m.startswith("nop") or "(" not in insn.operands:
                return False
            operands = split_operands(insn.operands)
            memory = [n for n, operand in enumerate(operands) if "(" in operand]
            # AT&T order: a `mov` whose only memory operand is the last one is a store.
            return not (m.startswith("mov") and memory == [len(operands) - 1])
        if self.name == "riscv64":
            return re.match(r"^(c\.)?(l[bhwd]u?|fl[hwdq]|lr)(sp)?(\.|$)", m) is not None
        return m.startswith("ld")

    def is_cond_branch(self, insn):
        m = insn.mnemonic
        if self.name == "x86_64":
            return m.startswith("j") and m not in ("jmp", "jmpq")
        if self.name == "riscv64":
            return m in RISCV_COND_BRANCHES
        return m.startswith("b.") or m in ("cbz", "cbnz", "tbz", "tbnz")

    def is_prologue(self, insn):
        m, ops = insn.mnemonic, insn.operands.replace(" ", "")
        if self.name == "x86_64":
            return (m in ("endbr64", "push", "pushq")
                    or (m in ("sub", "subq") and ops.endswith(",%rsp"))
                    or (m in ("mov", "movq") and ops == "%rsp,%rbp"))
        if self.name == "riscv64":
            # objdump prints `addi` with a negative immediate as `add`.
            return ((m in ("addi", "add") and ops.startswith("sp,sp,-"))
                    or (m == "sd" and ops.endswith("(sp)") and ops.split(",")[0] in ("ra", "s0"))
                    or (m in ("addi", "add") and ops.startswith("s0,sp,")))
        return (m in ("paciasp", "pacibsp", "bti")
                or (m == "stp" and "sp" in ops)
                or (m == "mov" and ops == "x29,sp")
                or (m == "sub" and ops.startswith("sp,sp")))

    def is_epilogue(self, insn):
        m, ops = insn.mnemonic, insn.operands.replace(" ", "")
        if self.name == "x86_64":
            return (m in ("pop", "popq", "leave", "leaveq")
                    or (m in ("add", "addq") and ops.endswith(",%rsp")))
        if self.name == "riscv64":
            return ((m in ("addi", "add") and re.match(r"^sp,sp,[0-9]", ops) is not None)
                    or (m == "ld" and ops.endswith("(sp)") and ops.split(",")[0] in ("ra", "s0")))
        return (m in ("autiasp", "autibsp")
                or (m == "ldp" and "sp" in ops)
                or (m == "add" and ops.startswith("sp,sp")))

    def direct_target(self, insn):
        """The address a direct branch goes to, or None for an indirect one."""
        if self.name == "x86_64":
            match = re.match(r"^([0-9a-f]+)(\s|$)", insn.operands)
        else:
            match = re.search(r"(?:^|,\s*)([0-9a-f]+)\s*(<|$)", insn.operands)
        return int(match.group(1), 16) if match else None


def split_operands(operands):
    """Operands split at the commas outside parentheses and brackets."""
    parts, depth, current = [], 0, ""
    for char in operands:
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def disassemble(binary, symbol):
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", f"--disassemble={symbol}", binary],
        check=True, capture_output=True, text=True).stdout
    arch_match = re.search(r"file format (\S+)", out)
    fmt = arch_match.group(1) if arch_match else ""
    if "x86-64" in fmt:
        arch = Arch("x86_64")
    elif "aarch64" in fmt:
        arch = Arch("aarch64")
    elif "riscv" in fmt:
        arch = Arch("riscv64")
    else:
        sys.exit(f"check_fast_path: unsupported file format {fmt!r} in {binary}")
    lines, insns, inside = [], [], False
    for line in out.splitlines():
        if re.match(rf"^[0-9a-f]+ <{re.escape(symbol)}>:$", line):
            inside = True
            lines.append(line)
            continue
        if inside and re.match(r"^[0-9a-f]+ <.*>:$", line):
            break  # the next symbol
        if not inside:
            continue
        if line.startswith("Disassembly of section"):
            break
        match = LINE.match(line)
        if not match:
            continue
        lines.append(line)
        text = match.group(2).split("#")[0].split("//")[0].strip()
        tokens = text.split(None, 1)
        if not tokens:
            continue
        while arch.name == "x86_64" and tokens[0] in X86_PREFIXES and len(tokens) > 1:
            tokens = tokens[1].split(None, 1)
        mnemonic = tokens[0]
        operands = tokens[1].strip() if len(tokens) > 1 else ""
        insns.append(Insn(int(match.group(1), 16), mnemonic, operands, text))
    return arch, lines, insns


def walk(arch, insns, start, stop_at_cond):
    """Follows fall-through and direct in-function jumps from index `start`.

    Returns (path, end, insn): the instructions passed, and how the walk ended: "ret",
    "cond" (stopped on a conditional branch, if stop_at_cond), "call", "out" (a jump that
    leaves the function or is indirect), "loop", or "end" (fell off the function).
    """
    index_of = {insn.address: i for i, insn in enumerate(insns)}
    path, seen, i = [], set(), start
    while i < len(insns):
        if i in seen:
            return path, "loop", insns[i]
        seen.add(i)
        insn = insns[i]
        if arch.is_ret(insn):
            return path, "ret", insn
        if arch.is_call(insn):
            return path, "call", insn
        if arch.is_cond_branch(insn):
            if stop_at_cond:
                return path, "cond", insn
            path.append(insn)
            i += 1
            continue
        if arch.is_jump(insn):
            target = arch.direct_target(insn)
            if target is None or target not in index_of:
                return path, "out", insn
            i = index_of[target]
            continue
        path.append(insn)
        i += 1
    return path, "end", None


def check(arch, insns, max_insns):
    """Returns (ok, report lines)."""
    report = []
    if not insns:
        return False, ["no instructions found"]
    i = 0
    prologue = []
    while i < len(insns) and arch.is_prologue(insns[i]):
        prologue.append(insns[i])
        i += 1
    before, how, last = walk(arch, insns, i, stop_at_cond=True)
    report.append(f"prologue (not counted): {len(prologue)} {prologue}")
    report.append(f"before the branch: {len(before)} {before}")
    if how in ("call", "out"):
        return False, report + [f"FAIL: {last} leaves the function before any branch"]
    if how in ("loop", "end"):
        return False, report + [f"FAIL: the path from the entry ends with {how!r}"]
    if how == "ret":
        body = [x for x in before if not arch.is_epilogue(x)]
        report.append(f"no branch: straight to {last}")
        if len(body) > max_insns:
            return False, report + [f"FAIL: {len(body)} instructions > {max_insns}"]
        return True, report + [f"OK: {len(body)} instructions, no branch"]

    branch = last
    report.append(f"branch: {branch}")
    if len(before) > max_insns:
        return False, report + [
            f"FAIL: {len(before)} instructions before the branch > {max_insns}"]
    index_of = {insn.address: n for n, insn in enumerate(insns)}
    branch_index = index_of[branch.address]
    target = arch.direct_target(branch)
    if target is None or target not in index_of:
        return False, report + [f"FAIL: the branch {branch} leaves the function"]
    sides = {"fall-through": branch_index + 1, "taken": index_of[target]}
    fast = None
    for name, start in sides.items():
        path, end, end_insn = walk(arch, insns, start, stop_at_cond=True)
        report.append(f"{name} side: {path} then {end} {end_insn if end_insn else ''}")
        if end == "ret" and fast is None:
            fast = (name, [x for x in path if not arch.is_epilogue(x)])
    if fast is None:
        return False, report + ["FAIL: neither side of the branch returns without a call"]
    name, after = fast
    total = len(before) + len(after)
    report.append(f"fast side: {name}; instructions after the branch: {len(after)} {after}")
    if total > max_insns:
        return False, report + [
            f"FAIL: fast path has {total} instructions (+1 branch) > {max_insns}"]
    return True, report + [f"OK: fast path = {total} instructions + 1 branch"
                           f" (limit {max_insns} + 1)"]


def shortest_call_free_return(arch, insns):
    """The shortest instruction path from the entry to a `ret` with no call and no jump out of
    the function, trying both sides of every conditional branch; None when there is none."""
    index_of = {insn.address: i for i, insn in enumerate(insns)}
    best = None
    # Depth-first over (index, path so far); a path never visits an instruction twice.
    stack = [(0, [])]
    while stack:
        i, path = stack.pop()
        if i >= len(insns) or any(p is insns[i] for p in path):
            continue
        if best is not None and len(path) >= len(best):
            continue
        insn = insns[i]
        if arch.is_ret(insn):
            best = path + [insn]
            continue
        if arch.is_call(insn):
            continue
        if arch.is_jump(insn):
            target = arch.direct_target(insn)
            if target in index_of:
                stack.append((index_of[target], path + [insn]))
            continue
        if arch.is_cond_branch(insn):
            target = arch.direct_target(insn)
            if target in index_of:
                stack.append((index_of[target], path + [insn]))
        stack.append((i + 1, path + [insn]))
    return best


def listing(arch, title, path, where):
    """The report's lines for `path`, and whether it is free of atomics."""
    report = [f"{title}: {len(path)} instructions"] + [f"    {insn}" for insn in path]
    atomics = [insn for insn in path if arch.is_atomic_rmw(insn)]
    if atomics:
        report.append(f"FAIL: atomic read-modify-write {where}: {atomics}")
    return not atomics, report


def check_lock_free(arch, insns):
    """Returns (ok, report lines) for the fast path of a per-CPU update."""
    if not insns:
        return False, ["no instructions found"]
    path = shortest_call_free_return(arch, insns)
    if path is None:
        return False, ["FAIL: no path from the entry reaches ret without a call"]
    ok, report = listing(arch, "shortest call-free path to ret", path, "on the fast path")
    if not ok:
        return False, report
    return True, report + ["OK: no lock prefix, atomic or call on the fast path"]


def innermost_call_free_loop(arch, insns):
    """The instructions from a backward branch's target to the branch, for the smallest such
    span that holds no call and no jump out of the function; None when there is none."""
    index_of = {insn.address: i for i, insn in enumerate(insns)}
    best = None
    for end, insn in enumerate(insns):
        if not (arch.is_cond_branch(insn) or arch.is_jump(insn)):
            continue
        target = arch.direct_target(insn)
        if target is None or target not in index_of or index_of[target] > end:
            continue
        body = insns[index_of[target]:end + 1]
        leaves = any(arch.is_call(x) or (arch.is_jump(x) and arch.direct_target(x) not in
                                          index_of) for x in body)
        if not leaves and (best is None or len(body) < len(best)):
            best = body
    return best


def check_adder_loop(arch, insns, max_reads):
    """Returns (ok, report lines) for the loop of adds through one adder."""
    if not insns:
        return False, ["no instructions found"]
    body = innermost_call_free_loop(arch, insns)
    if body is None:
        return False, ["FAIL: no loop without a call found"]
    ok, report = listing(arch, "innermost call-free loop", body, "in the loop")
    if not ok:
        return False, report
    reads = [insn for insn in body if arch.reads_memory(insn)]
    report.append(f"instructions that read memory: {len(reads)} {reads}")
    if len(reads) > max_reads:
        return False, report + [f"FAIL: {len(reads)} reads > {max_reads}: something the adder "
                                "holds is loaded again on every add"]
    return True, report + [f"OK: {len(reads)} reads (limit {max_reads}), no atomic, no call"]


def build_probe():
    """Builds the release example and returns its path (honours CARGO_TARGET_DIR)."""
    cmd = ["cargo", "build", "--release", "-p", "thiscpu", "--example", "fast_path_probe",
           "--message-format=json-render-diagnostics"]
    print("+ " + " ".join(cmd), flush=True)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    executable = None
    for line in out.splitlines():
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            continue
        if (message.get("reason") == "compiler-artifact"
                and message.get("target", {}).get("name") == "fast_path_probe"
                and message.get("executable")):
            executable = message["executable"]
    if not executable or not os.path.exists(executable):
        sys.exit("check_fast_path: cargo did not report the fast_path_probe executable")
    return executable


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", help="binary to check (default: build the probe example)")
    parser.add_argument("--symbol", default=SYMBOL)
    parser.add_argument("--max-insns", type=int, default=MAX_INSNS)
    parser.add_argument("--lock-free-symbol", default=LOCK_FREE_SYMBOL,
                        help="function whose fast path must hold no atomic (empty: skip)")
    parser.add_argument("--adder-loop-symbol", default=ADDER_LOOP_SYMBOL,
                        help="function whose loop must keep the adder in registers "
                             "(empty: skip)")
    parser.add_argument("--max-loop-reads", type=int, default=MAX_LOOP_READS)
    args = parser.parse_args()

    binary = args.binary or build_probe()
    arch, lines, insns = disassemble(binary, args.symbol)
    print(f"objdump -d --no-show-raw-insn --disassemble={args.symbol} {binary}")
    for line in lines:
        print("    " + line)
    if not insns:
        print(f"FAIL: symbol {args.symbol} not found or empty in {binary}")
        return 1
    ok, report = check(arch, insns, args.max_insns)
    for line in report:
        print(line)
    if not args.lock_free_symbol:
        return 0 if ok else 1
    arch, lines, insns = disassemble(binary, args.lock_free_symbol)
    print()
    print(f"objdump -d --no-show-raw-insn --disassemble={args.lock_free_symbol} {binary}")
    for line in lines:
        print("    " + line)
    lock_free, report = check_lock_free(arch, insns)
    for line in report:
        print(line)
    if not args.adder_loop_symbol:
        return 0 if ok and lock_free else 1
    arch, lines, insns = disassemble(binary, args.adder_loop_symbol)
    print()
    print(f"objdump -d --no-show-raw-insn --disassemble={args.adder_loop_symbol} {binary}")
    for line in lines:
        print("    " + line)
    adder_loop, report = check_adder_loop(arch, insns, args.max_loop_reads)
    for line in report:
        print(line)
    return 0 if ok and lock_free and adder_loop else 1


if __name__ == "__main__":
    sys.exit(main())
