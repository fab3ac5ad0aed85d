"""The package's structure, walked over every module of ``src/torch_contrastive`` (a new module is covered by
being there): no module imports another's private name, the engine's modules import each other without a cycle
(lazy imports counted, type-only ones not), and the device type is read only where a plan is made -- the
planner and the policy -- or where an API needs it (autocast) or a kernel checks what it can run; and a reader
follows ``clip_loss`` to its first matrix product in at most five files."""

from __future__ import annotations

import ast
import pathlib
import traceback
from collections.abc import Iterator

import pytest
import torch

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = "torch_contrastive"

#: Modules that may read a device's type, and why (everything else takes the plan's answer).
DEVICE_READS = {
    "torch_contrastive.engine.planner": "the plan: every device-dependent decision is made here",
    "torch_contrastive.engine.policy": "the policy: one ordered list of rules per device",
    "torch_contrastive.engine.products": "torch.mm's fp32-output overload of half operands exists on CUDA only "
                                         "(a CPU widens the operands: the same numbers)",
    "torch_contrastive.engine.triton_backend._host": "the Triton kernels' own refusal of a tensor they cannot run on",
}
#: Calls that take a device type as their argument (reading it for them decides nothing).
DEVICE_TYPE_APIS = {"autocast", "autocast_enabled", "_autocast", "is_autocast_enabled"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def _target(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``import from`` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> Iterator[tuple[str, str | None]]:
    """``(module imported, name taken from it or None)`` for each runtime import of the package's own modules."""
    for node in _runtime_nodes(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom):
            source = _target(module, node)
            if source.startswith(PACKAGE):
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    yield (full, None) if full in MODULES else (source, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE):
                    yield alias.name, None


def test_no_module_takes_another_modules_private_name():
    """A private name is its module's own: imported (``from m import _x``) or read off an imported module
    (``m._x``) elsewhere, it is a public name in disguise -- made public where it is defined, or not shared."""
    taken = []
    for module, path in MODULES.items():
        bound = {}
        for source, name in _imports(module):
            if name is not None and name.startswith("_") and not name.startswith("__") and source != module:
                taken.append(f"{module} imports {source}.{name}")
            if name is None or f"{source}.{name}" in MODULES:
                bound[(name or source).rsplit(".", 1)[-1]] = source if name is None else f"{source}.{name}"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                taken.append(f"{module} reads {bound[node.value.id]}.{node.attr}")
    assert not taken, "\n".join(sorted(set(taken)))


def _cycles(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root] & nodes)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child] & nodes))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_engine_imports_without_a_cycle():
    """The engine's modules form a layered graph: each imports only modules below it (an import inside a function
    counts -- it hides a cycle, it does not remove one; the package's ``__init__`` re-exporting its modules does
    not: no engine module imports the package)."""
    engine = {m for m in MODULES if m.startswith(f"{PACKAGE}.engine.")}
    edges = {m: {source for source, _ in _imports(m)} for m in MODULES}
    assert not any(f"{PACKAGE}.engine" in edges[m] for m in engine), "an engine module imports the engine package"
    assert _cycles(engine, edges) == []


def test_the_cycle_finder_finds_a_cycle():
    """The check above can fail: a lazy import back up is a cycle."""
    nodes = {"a", "b", "c", "d"}
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(nodes, edges) == [["a", "b", "c"]]
    assert _cycles(nodes, {**edges, "c": set()}) == []


def _device_reads(tree: ast.AST) -> Iterator[ast.AST]:
    """``x.device.type``, ``device.type``, ``x.is_cuda`` and comparisons with ``"cuda"``, except a device type
    handed straight to an API that takes one (:data:`DEVICE_TYPE_APIS`)."""
    handed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in DEVICE_TYPE_APIS:
                handed.update(id(arg) for arg in node.args)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in handed:
            if node.attr == "is_cuda" or (node.attr == "type" and "dev" in ast.unparse(node.value).rsplit(".", 1)[-1]):
                yield node
        elif isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value == "cuda" for c in (node.left, *node.comparators)):
            yield node


@pytest.mark.parametrize("module", [m for m in MODULES if not m.startswith(f"{PACKAGE}.cli")])
def test_only_the_plan_reads_the_device_type(module):
    """No loss, relation, normalisation or executor decides by the device: the plan does (``cli`` picks a training
    run's device and is not walked)."""
    reads = [f"line {node.lineno}: {ast.unparse(node)}" for node in _device_reads(ast.parse(MODULES[module].read_text()))]
    if module in DEVICE_READS:
        assert reads, f"{module} is allowed a device read it no longer makes: drop it from DEVICE_READS"
    else:
        assert not reads, f"{module} reads the device type:\n" + "\n".join(reads)


def test_the_device_read_finder_finds_one():
    """The check above can fail."""
    tree = ast.parse("a = x.device.type == 'cuda'\nb = y.is_cuda\nwith torch.autocast(z.device.type):\n    pass")
    assert len(list(_device_reads(tree))) == 3  # the comparison, its device.type, is_cuda; not autocast's


def test_no_test_file_imports_another():
    """Tests share what they share through the helpers modules (``helpers``, ``reference``, ``peers``, ...), never
    by importing another test file: walked over every test file of the suite."""
    tests = pathlib.Path(__file__).resolve().parent
    taken = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            taken += [f"{path.relative_to(tests)} imports {n}" for n in names if n.rsplit(".", 1)[-1].startswith("test_")]
    assert not taken, "\n".join(taken)


#: The most parameters a Triton kernel takes (ml-cross-entropy's take about 28): an exclusion, a pair relation and a
#: folded positive part are one tuple argument each (``excl``, ``rel``, ``pos``), not eleven, seven and eight.
KERNEL_PARAMETERS = 30


def _jit_functions(tree: ast.Module) -> Iterator[ast.FunctionDef]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
                (isinstance(d, ast.Attribute) and d.attr == "jit") or (isinstance(d, ast.Name) and d.id == "jit")
                for d in node.decorator_list):
            yield node


def test_every_triton_kernel_takes_at_most_thirty_parameters():
    """Walked over every ``@triton.jit`` function of the package (kernels and the device functions they call)."""
    found = {f"{path.name}:{fn.name}": len(fn.args.args) for path in sorted(SRC.rglob("*.py"))
             for fn in _jit_functions(ast.parse(path.read_text()))}
    assert len(found) > 20  # the walk sees the kernels
    assert {name: n for name, n in found.items() if n > KERNEL_PARAMETERS} == {}


def test_the_kernel_walk_counts_a_wide_kernel():
    source = "@triton.jit\ndef k(" + ", ".join(f"a{i}" for i in range(31)) + "):\n    pass\n"
    (fn,) = _jit_functions(ast.parse(source))
    assert len(fn.args.args) == 31 > KERNEL_PARAMETERS


class _FirstProduct(Exception):
    """Raised by the patched products at the first one a call makes: it carries the stack there."""

    def __init__(self, stack: traceback.StackSummary) -> None:
        super().__init__("first product")
        self.stack = stack


#: The product ops of ATen a loss's logits can start from, on the module and on the tensor.
_PRODUCTS = ((torch, ("mm", "matmul", "addmm", "bmm", "baddbmm", "einsum")),
             (torch.Tensor, ("mm", "matmul", "__matmul__", "addmm", "addmm_")))


def _files_to_first_product(call, monkeypatch) -> list[str]:
    """The package's files on the stack at ``call``'s first matrix product, outermost first, each once: what a
    reader opens to follow the call to the product."""
    def stop(*args, **kwargs):
        raise _FirstProduct(traceback.extract_stack())

    for owner, names in _PRODUCTS:
        for name in names:
            monkeypatch.setattr(owner, name, stop)
    with pytest.raises(_FirstProduct) as caught:
        call()
    monkeypatch.undo()
    files = [pathlib.Path(frame.filename) for frame in caught.value.stack]
    ours = [str(f.relative_to(SRC / PACKAGE)) for f in files if (SRC / PACKAGE) in f.parents]
    return list(dict.fromkeys(ours))


#: The most files a reader opens following ``clip_loss`` to its first matrix product (the loss's decorator counted).
TRAIL_FILES = 5


def test_clip_loss_reaches_its_first_product_within_five_files(monkeypatch):
    """A default call -- a batch whose logits are one tile, every CPU call up to about 1k x 1k -- goes loss, the
    engine's entry, the strategy, its form; docs/engine.md ("Reading the engine") lists them and the tiled path."""
    import torch_contrastive as tc

    image, text = torch.randn(256, 32), torch.randn(256, 32)
    trail = _files_to_first_product(lambda: tc.clip_loss(image, text), monkeypatch)
    assert trail[-1] == "engine/one_tile.py" and len(trail) <= TRAIL_FILES, trail


def test_the_trail_follows_a_tiled_call_to_its_tile_loop(monkeypatch):
    """The walk above can fail: a tiled call's trail runs through the driver and the tile loop to the products."""
    import torch_contrastive as tc

    image, text = torch.randn(256, 32), torch.randn(256, 32)
    trail = _files_to_first_product(lambda: tc.clip_loss(image, text, chunk_size=64), monkeypatch)
    assert {"losses/image_text.py", "engine/driver.py", "engine/tiling.py"} <= set(trail)
    assert trail[-1] == "engine/products.py", trail
