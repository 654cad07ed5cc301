#!/usr/bin/env python3
"""Checks that the modules of each crate stand in layers: no module reaches, through the
modules it names, back to itself.

A room is a top-level module of a crate: one file under src/ or one directory (its files
together). An arrow runs from a room to every room whose items its code names through
`crate::` (in `use` lists and in paths); a name re-exported by the crate root (`pub use
cpu::getcpu` in lib.rs) counts as an arrow to the module that defines it. Unit tests
(`#[cfg(test)] mod tests`) are left out: they may reach anywhere. Any circle among rooms is
printed with the names that tie it, and fails the check.

Usage: check_layers.py [SRC_DIR ...]   (default: every crate's src/ in the workspace)
"""

import re
import sys
from pathlib import Path

PATH = re.compile(r"\b((?:crate|super|[a-z_][a-z0-9_]*)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE = re.compile(r"\buse\s+([^;]*);", re.S)
TEST_ONLY_MODULE = re.compile(r"#\[cfg\([^\]]*\btest\b[^\]]*\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*([;{])")


def code_of(path):
    """The file's code without comments, string literals and test-only modules."""
    text = "\n".join(line.split("//", 1)[0] for line in path.read_text().splitlines())
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text, flags=re.S)
    inline = [m for m in TEST_ONLY_MODULE.finditer(text) if m.group(2) == "{"]
    return text[: inline[0].start()] if inline else text


def test_only_files(src):
    """Files that only `#[cfg(test)]` declarations bring in."""
    files = set()
    for path in src.rglob("*.rs"):
        here = path.parent if path.name in ("mod.rs", "lib.rs", "main.rs") else path.with_suffix("")
        for m in TEST_ONLY_MODULE.finditer(path.read_text()):
            if m.group(2) == ";":
                files |= {here / f"{m.group(1)}.rs", here / m.group(1) / "mod.rs"}
    return files


def module_dir(path, src):
    """The directory in which the module of `path` finds its child modules."""
    if path.name in ("mod.rs", "lib.rs", "main.rs"):
        return path.parent
    return path.with_suffix("")


def resolve(segments, base_dir, src):
    """The file that the longest module prefix of `segments` names, from `base_dir`."""
    found, directory = None, base_dir
    for segment in segments:
        if (directory / segment / "mod.rs").exists():
            found, directory = directory / segment / "mod.rs", directory / segment
        elif (directory / f"{segment}.rs").exists():
            found, directory = directory / f"{segment}.rs", directory / segment
        else:
            break
    return found


class Crate:
    def __init__(self, src):
        self.src = src
        self.root = next((src / n for n in ("lib.rs", "main.rs") if (src / n).exists()), None)
        excluded = test_only_files(src) | {self.root}
        self.files = sorted(p for p in src.rglob("*.rs") if p not in excluded)
        self.reexported = {}
        if self.root:
            for use in re.findall(r"\bpub\s+use\s+([^;]*);", code_of(self.root)):
                if "::" not in use:
                    continue
                head = use.split("::")[0].strip()
                for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", use.split("::", 1)[1]):
                    self.reexported.setdefault(name, head)

    def target(self, path_text, path):
        segments = path_text.split("::")
        if segments[0] == "crate":
            rest = segments[1:]
            if rest and rest[0] in self.reexported and not resolve(rest[:1], self.src, self.src):
                rest = [self.reexported[rest[0]]] + rest
            return resolve(rest, self.src, self.src)
        if segments[0] == "super":
            directory = module_dir(path, self.src).parent
            while len(segments) > 1 and segments[1] == "super":
                directory, segments = directory.parent, segments[1:]
            parent = directory / "mod.rs" if (directory / "mod.rs").exists() else directory.with_suffix(".rs")
            return resolve(segments[1:], directory, self.src) or (parent if parent.exists() else None)
        return None

    def arrows(self):
        """file -> {file: names} from every `crate::` and `super::` path, and every path that
        starts with a name a `use crate::...` brought in."""
        graph = {f: {} for f in self.files}
        for path in self.files:
            code = code_of(path)
            aliases = {}
            for use in USE.findall(code):
                for full in expand_use(use.strip()):
                    aliases[full.split("::")[-1]] = full
            paths = [m.group(1) for m in PATH.finditer(code)]
            paths += list(aliases.values())
            for text in paths:
                head = text.split("::")[0]
                if head not in ("crate", "super") and head in aliases:
                    text = aliases[head] + text[len(head):]
                target = self.target(text, path)
                if target and target != path and target in graph:
                    graph[path].setdefault(target, set()).add(text.split("::")[-1])
        return graph


def expand_use(use):
    """`crate::a::{b, c::d}` -> [`crate::a::b`, `crate::a::c::d`] (one level of braces)."""
    m = re.match(r"((?:crate|super)(?:::\w+)*)::\{(.*)\}$", use, re.S)
    if m:
        out = []
        for part in m.group(2).split(","):
            part = part.strip().split(" as ")[0].strip()
            if part and "{" not in part and "}" not in part:
                out.append(m.group(1) if part == "self" else f"{m.group(1)}::{part}")
        return out
    if re.match(r"(?:crate|super)::", use):
        return [use.split(" as ")[0].strip()]
    return []


def circles(graph):
    """Strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def main(argv):
    repo = Path(__file__).resolve().parent.parent
    crates = sorted(manifest.parent for manifest in repo.glob("*/Cargo.toml"))
    sources = [Path(a) for a in argv] or [c / "src" for c in crates if (c / "src").is_dir()]
    failed = False
    for src in sources:
        graph = Crate(src).arrows()
        count = sum(len(targets) for targets in graph.values())
        found = circles(graph)
        print(f"{src}: {len(graph)} files, {count} arrows, {len(found)} circles")
        for component in found:
            failed = True
            print(f"  circle: {', '.join(str(f.relative_to(src)) for f in component)}")
            for path in component:
                for target, names in sorted(graph[path].items()):
                    if target in component:
                        print(f"    {path.relative_to(src)} -> {target.relative_to(src)}:"
                              f" {', '.join(sorted(names))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
