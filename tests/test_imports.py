"""brisk's packages import downward only: the import graph of src/brisk, read from the source with `ast`.

Every import counts, at module level and inside functions, except those under `if TYPE_CHECKING:` (annotations,
never run). The checks:
  - no circle between packages (engine -> parallel -> engine, ...);
  - at most one circle between the modules of one package;
  - no import goes up the layer order (LAYERS, from the bottom);
  - an import made inside a function says why on its line (or the comment line above): `# optional: <package>`
    for a dependency brisk runs without, `# start-up: <cost>` for one kept off the import of the module.
README.md's package map lists exactly the subpackages of src/brisk.

`python tests/test_imports.py` prints the counts.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "brisk"

# The packages from the bottom up. A package may import those on its own level or below, never above; `console`
# is the module brisk/console.py, `brisk` the top-level `__init__.py` (the public API), `cli` the command line.
LAYERS: list[tuple[str, ...]] = [
    ("data",),                               # the shipped texts
    ("structured",),                         # constraints as token masks (llguidance)
    ("ops",),                                # attention, linears (float, quantized, sparse), the C++ kernels
    ("console",),                            # stderr console, progress bars, peak memory, JSON records
    ("kvcache",),                            # block pool, KV manager, quantized caches, eviction
    ("model",),                              # configs, architectures, loaders, tokenizer, fusion
    ("quant",),                              # primitives, methods, quantized layers and checkpoints
    ("prune",),                              # masks, methods, pruned checkpoints
    ("lora",),                               # adapters, their batched layers, fine-tuning
    ("engine",),                             # scheduler, runner, decode plan, verification, sampler, LLM
    ("spec", "parallel"),                    # proposers; tensor / pipeline parallel runners
    ("eval", "train"),                       # perplexity, size; the trainer and distillation
    ("serve",),                              # the OpenAI-compatible server
    ("bench",),                              # benchmarks (the server's too)
    ("advise",),                             # the configuration advisor, from the benchmarks' figures
    ("cli", "brisk"),                        # `brisk ...` and the package's public names
]
# Upward imports not yet removed, as (importer, imported) packages: this list only shrinks (a pair that no longer
# occurs fails test_known_upward_imports_still_occur).
KNOWN_UPWARD: set[tuple[str, str]] = {
    ("ops", "kvcache"),      # ops/attention.py tells quantized caches apart by their class
    ("kvcache", "model"),    # kvcache/quant.py allocates on huge pages (model/hugepages.py)
    ("model", "quant"),      # the loaders read quantized and community checkpoints (quant/checkpoint, community)
    ("model", "lora"),       # model/export_cli.py merges adapters
    ("quant", "eval"),       # llm_int8's outlier threshold search measures perplexity
    ("quant", "spec"),       # quant/cli.py trims a draft's vocabulary
    ("quant", "train"),      # QAT and SqueezeLLM's fine-tuning run the trainer
    ("lora", "train"),       # LoRA fine-tuning runs the trainer
    ("quant", "prune"),      # quant/cli.py carries a pruned source's sparsity_config on
    ("lora", "brisk"),       # lora/answers.py generates the fine-tuning answers with LLM
    ("bench", "advise"),     # bench/report_cmd.py: `brisk report` recommends with the advisor
    ("spec", "train"),       # head training runs the trainer
    ("serve", "brisk"),      # the version
    ("bench", "brisk"),
}
# Circles between the modules of one package (each through imports made inside functions), not yet broken.
KNOWN_MODULE_CIRCLES = {"bench", "model", "ops", "quant", "spec"}
LEVEL = {package: level for level, packages in enumerate(LAYERS) for package in packages}
# the distributions `pip install brisk` brings (pyproject.toml's dependencies); any other is optional
REQUIRED = {"torch", "numpy", "safetensors", "tokenizers", "gguf", "jinja2", "llguidance", "click", "rich", "psutil",
            "fastapi", "uvicorn", "prometheus_client", "ninja", "httpx", "anyio", "starlette", "pydantic"}
REASON = re.compile(r"#\s*(optional|start-up):\s*\S")


@dataclass(frozen=True)
class Import:
    importer: str        # dotted name of the importing module
    target: str          # dotted name of the imported module (brisk's own, resolved) or the top-level distribution
    line: int
    in_function: bool
    reason: str | None   # "optional" / "start-up" when the line says why

    @property
    def internal(self) -> bool:
        return self.target == "brisk" or self.target.startswith("brisk.")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """The layer a module belongs to: its subpackage, or the top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "brisk"


def _is_module(dotted: str) -> bool:
    base = SRC.parent.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, lines: list[str]) -> None:
        self.module, self.is_package, self.lines = module, is_package, lines
        self.depth = 0
        self.found: list[Import] = []

    def _reason(self, node: ast.stmt) -> str | None:
        end = node.end_lineno or node.lineno
        text = self.lines[node.lineno - 1:end]
        above = self.lines[node.lineno - 2] if node.lineno >= 2 else ""
        if above.strip().startswith("#"):
            text = [above, *text]
        match = REASON.search("\n".join(text))
        return match.group(1) if match else None

    def _add(self, node: ast.stmt, target: str) -> None:
        if target.startswith("brisk"):
            while target != "brisk" and not _is_module(target):
                target = target.rsplit(".", 1)[0]
        else:
            target = target.split(".")[0]
        self.found.append(Import(self.module, target, node.lineno, self.depth > 0, self._reason(node)))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.module.split(".")
            if not self.is_package:
                package = package[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        if base.startswith("brisk"):
            # `from brisk.x import y` imports the module brisk.x.y when there is one, else a name of brisk.x
            for alias in node.names:
                self._add(node, f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base)
        else:
            self._add(node, base)

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function


def collect_imports(src: Path = SRC) -> list[Import]:
    found: list[Import] = []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        collector = _Collector(module_name(path), path.name == "__init__.py", text.splitlines())
        collector.visit(ast.parse(text, filename=str(path)))
        found += collector.found
    return found


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    nodes = sorted(set(edges) | {b for targets in edges.values() for b in targets})

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in nodes:
        if node not in index:
            connect(node)
    return sorted(out)


def package_edges(imports: Iterable[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        if imp.internal and package_of(imp.importer) != package_of(imp.target):
            edges[package_of(imp.importer)].add(package_of(imp.target))
    return edges


def module_circles(imports: Iterable[Import]) -> dict[str, list[list[str]]]:
    """Per package, the circles between its modules."""
    by_package: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for imp in imports:
        package = package_of(imp.importer)
        if imp.internal and package != "brisk" and package_of(imp.target) == package and imp.target != imp.importer:
            by_package[package][imp.importer].add(imp.target)
    return {package: found for package, edges in sorted(by_package.items()) if (found := circles(edges))}


def upward(imports: Iterable[Import]) -> list[Import]:
    return [imp for imp in imports if imp.internal
            and LEVEL[package_of(imp.target)] > LEVEL[package_of(imp.importer)]]


def unexplained(imports: Iterable[Import]) -> list[Import]:
    """Imports inside functions whose line does not say why they are there."""
    return [imp for imp in imports if imp.in_function and imp.reason is None]


def _pair(imp: Import) -> tuple[str, str]:
    return package_of(imp.importer), package_of(imp.target)


def _show(imp: Import) -> str:
    return f"{imp.importer}:{imp.line} -> {imp.target}"


# ---------------------------------------------------------------------------------------------------------- tests

IMPORTS = collect_imports()


def test_every_package_has_a_layer() -> None:
    packages = {package_of(module_name(p)) for p in SRC.rglob("*.py")}
    assert packages <= set(LEVEL), f"packages with no layer: {sorted(packages - set(LEVEL))}"


def test_no_circle_between_packages() -> None:
    edges = package_edges(IMPORTS)
    for importer, imported in KNOWN_UPWARD:
        edges.get(importer, set()).discard(imported)
    assert circles(edges) == []


def test_at_most_one_circle_inside_a_package() -> None:
    found = {package: c for package, c in module_circles(IMPORTS).items() if package not in KNOWN_MODULE_CIRCLES}
    assert sum(len(c) for c in found.values()) <= 1, found


def test_imports_go_down_the_layers() -> None:
    assert [_show(imp) for imp in upward(IMPORTS) if _pair(imp) not in KNOWN_UPWARD] == []


def test_known_upward_imports_still_occur() -> None:
    assert sorted(KNOWN_UPWARD - {_pair(imp) for imp in upward(IMPORTS)}) == []
    assert sorted(KNOWN_MODULE_CIRCLES - set(module_circles(IMPORTS))) == []


def test_imports_inside_functions_say_why() -> None:
    """A brisk module imported inside a function either lies below (or beside) the importer, or the line says why
    it is imported there (`# optional: ...`, `# start-up: ...`)."""
    assert [_show(imp) for imp in upward(IMPORTS) if imp.in_function and imp.reason is None
            and _pair(imp) not in KNOWN_UPWARD] == []


def test_type_checking_blocks_are_left_out() -> None:
    code = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import brisk.engine.llm\n"
    collector = _Collector("brisk.x", False, code.splitlines())
    collector.visit(ast.parse(code))
    assert [imp.target for imp in collector.found] == ["typing"]


def _readme_packages() -> set[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("```\nsrc/brisk/\n", 1)[1].split("```", 1)[0]
    return {m.group(1) for m in re.finditer(r"^  (\w+)/", block, re.MULTILINE)}


def test_readme_package_map_matches_the_tree() -> None:
    tree = {p.parent.name for p in SRC.glob("*/__init__.py")}
    listed = _readme_packages()
    assert sorted(tree - listed) == [], "subpackages missing from README.md's map"
    assert sorted(listed - tree) == [], "README.md's map lists packages that do not exist"


def report() -> None:
    imports = IMPORTS
    internal = [imp for imp in imports if imp.internal]
    in_function = [imp for imp in imports if imp.in_function]
    pkg = circles(package_edges(imports))
    mod = module_circles(imports)
    # pairs of packages that import each other once the imports inside functions count too, and that the
    # module-level imports alone do not show
    both = package_edges(imports)
    top = package_edges([imp for imp in imports if not imp.in_function])
    pairs = {tuple(sorted((a, b))) for a in both for b in both[a] if a in both.get(b, ())}
    hidden = {p for p in pairs if not (p[1] in top.get(p[0], ()) and p[0] in top.get(p[1], ()))}
    print(f"imports: {len(imports)} ({len(internal)} of brisk modules)")
    print(f"circles between packages: {len(pkg)}")
    for c in pkg:
        print("   ", " <-> ".join(c))
    top_level = [imp for imp in imports if not imp.in_function]
    print(f"  of module-level imports alone: {circles(package_edges(top_level))}")
    print(f"circles inside packages: {sum(len(c) for c in mod.values())}"
          f" ({sum(len(c) for c in module_circles(top_level).values())} of module-level imports alone)")
    for package, found in mod.items():
        for c in found:
            print(f"    {package}: {' <-> '.join(c)}")
    print(f"pairs of packages importing each other: {len(pairs)} ({len(hidden)} only through function-level imports)")
    for p in sorted(hidden):
        print("   ", " <-> ".join(p))
    up = upward(imports)
    print(f"upward imports: {len(up)} ({sum(imp.in_function for imp in up)} inside functions)")
    for (a, b), n in sorted(Counter((package_of(i.importer), package_of(i.target)) for i in up).items()):
        print(f"    {a} -> {b}: {n}")
    statements: dict[tuple[str, int], list[Import]] = defaultdict(list)
    for imp in in_function:
        statements[imp.importer, imp.line].append(imp)
    kinds: Counter[str] = Counter()
    for found in statements.values():
        imp = found[0]
        if imp.internal:
            up = any(LEVEL[package_of(i.target)] > LEVEL[package_of(i.importer)] for i in found)
            same = all(package_of(i.target) == package_of(i.importer) for i in found)
            kind = "brisk, upward" if up else "brisk, same package" if same else "brisk, downward"
        elif imp.target in sys.stdlib_module_names:
            kind = "standard library"
        elif imp.target in REQUIRED:
            kind = f"required: {imp.target}"
        else:
            kind = f"optional: {imp.target}"
        kinds[kind] += 1
    reasons = Counter(found[0].reason or "none" for found in statements.values())
    print(f"import statements inside functions: {len(statements)}, by the reason their line gives: {dict(reasons)}")
    for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"    {kind}: {n}")
    if "-v" in sys.argv:
        for imp in unexplained(imports):
            print("   ", _show(imp))


if __name__ == "__main__":
    report()
