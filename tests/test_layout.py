"""The package's shape: modules stay readable in one sitting (a line budget), dependencies point one way, and every
shape in a comment or docstring speaks the one legend of :mod:`tformer`."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import tformer

PACKAGE = Path(tformer.__file__).resolve().parent
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
LINE_BUDGET = 500
# Modules allowed past the budget, and why.
OVER_BUDGET = {
    "claims/worker.py": "the sandbox worker runs as a script (python -I path/worker.py), so it cannot import a "
    "sibling module: its policy, namespace, limits and audit hook live in one file",
}
# Dependencies point one way: a module may import its own layer and the layers below.
LAYERS = {
    "config": 0,
    "functional": 0,
    "attention": 1,
    "positions": 2,
    "layers": 2,
    "models": 3,
    "runtime": 3,  # where a model runs (devices, wrappers, the cache folder): torch only, shared above the models
    "tokenizers": 3,  # text <-> ids: shared by generation, interop, training and the explorer
    "engine": 4,  # the CPU decode engine, applied to the models from outside: the core imports nothing of it
    "generation": 5,
    "interop": 6,  # Hugging Face and GGUF checkpoints, the shipped models: read by training's fine-tuning
    "hooks": 6,  # named activations: caching and interventions on the core's hook points
    "circuits": 7,  # logit lens, attribution, ablation, patching, induction: built on the hooks
    "training": 7,
    "experiments": 7,
    "claims": 7,
    "evaluation": 7,  # benchmark scores of the loaded models (interop), lm-eval's model class: the report shows them
    "explore": 8,
    "cli": 9,
    "__main__": 9,
}
CORE = ("config", "functional", "attention", "positions", "layers", "models")  # the Transformer, and only it


def relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def layer_of(module: str) -> str:
    """``tformer.training.trainer`` -> ``training``; ``tformer`` itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_module_outgrows_the_line_budget_without_a_stated_reason():
    over = {relative(p): n for p in MODULES if (n := len(p.read_text().splitlines())) > LINE_BUDGET}
    assert set(over) <= set(OVER_BUDGET), f"over {LINE_BUDGET} lines: {over}"
    stale = set(OVER_BUDGET) - set(over)
    assert not stale, f"these modules are back under the budget; drop their exception: {stale}"


@pytest.mark.parametrize("path", MODULES, ids=relative)
def test_imports_point_down_the_layers(path):
    own = (
        "cli"
        if path.name == "__main__.py"
        else layer_of("tformer." + relative(path).removesuffix(".py").replace("/", "."))
    )
    if own == "__init__.py" or relative(path) == "__init__.py":
        return  # the package's lazy exports name every layer
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            if name == "tformer" or not name.startswith("tformer."):
                continue
            target = layer_of(name)
            assert LAYERS[target] <= LAYERS[own], f"{relative(path)} ({own}) imports {name} ({target})"


# --------------------------------------------------------------------------------------------------
# The shape legend
# --------------------------------------------------------------------------------------------------
def legend() -> dict[str, str]:
    """Symbol -> meaning, read from the package docstring's legend block."""
    block = tformer.__doc__.split("Shapes:", 1)[1]
    rows = [re.match(r"^    (\w+)\s{2,}(\S.*)$", line) for line in block.splitlines()]
    return {m.group(1): m.group(2) for m in rows if m}


def shapes_line(path: Path) -> set[str]:
    """The symbols a module's docstring says it uses (``Shapes: B, T, C (...)``)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    match = re.search(r"Shapes: (.*?)\(the package legend", " ".join(doc.split()))
    return set(re.findall(r"\b[A-Z]\w*", match.group(1))) if match else set()


SHAPE_ITEM = re.compile(r"\*?\w+(?:\|\w+)?(?:\s*[-+*/]\s*\w+)*|\d+\s+\w+(?:\s*[-+*/]\s*\w+)*|\.\.\.")


def shape_tuples(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, tuple, symbols)`` for every shape in a comment, or in a docstring after a name (``x (B, T, C)``)."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            candidates = re.finditer(r"\(([^()]*,[^()]*)\)", tok.string)
        elif tok.type == tokenize.STRING and tok.string.lstrip("rb").startswith('"""'):
            candidates = re.finditer(r"``\w+ \(([^()`]*,[^()`]*)\)", tok.string)
        else:
            continue
        for m in candidates:
            items = [i.strip() for i in m.group(1).split(",")]
            if not all(SHAPE_ITEM.fullmatch(i) for i in items):
                continue  # prose in parentheses
            symbols = [t for i in items for t in re.findall(r"[A-Za-z_]\w*", i) if t[0].isupper()]
            if symbols:
                found.append((tok.start[0], m.group(0), symbols))
    return found


def test_the_legend_defines_each_symbol_once():
    text = tformer.__doc__.split("Shapes:", 1)[1]
    symbols = re.findall(r"^    (\w+)\s{2,}", text, flags=re.M)
    assert len(symbols) == len(set(symbols)) > 15
    assert {"B", "T", "C", "H", "Hkv", "D", "Dv", "L", "S", "V"} <= set(symbols)


@pytest.mark.parametrize("path", MODULES, ids=relative)
def test_shapes_use_the_legend_and_the_letters_the_module_names(path):
    known = set(legend()) | {"BLOCK_DV"}  # named in BLOCK_D's line
    named = shapes_line(path)
    assert named <= known, f"{relative(path)}: its Shapes line names {named - known}, not in the package legend"
    tuples = shape_tuples(path)
    for line, shape, symbols in tuples:
        unknown = [s for s in symbols if s not in known]
        assert not unknown, f"{relative(path)}:{line}: {shape} uses {unknown}, not in the package legend"
    used = {s for _, _, symbols in tuples for s in symbols}
    if used:
        assert named, f"{relative(path)} writes shapes ({sorted(used)}) but its docstring names no 'Shapes:'"
        assert used <= named, f"{relative(path)}: shapes use {sorted(used - named)}, not named in its Shapes line"


FUNCTION_BUDGET = 60  # lines of one function in tformer.training (the loop was one 188-line function once)


def test_no_training_function_outgrows_its_budget():
    long = []
    for path in MODULES:
        if not relative(path).startswith("training/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_BUDGET:
                    long.append(f"{relative(path)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


# folders whose modules the package tree of docs/model.md names one by one (cli/, claims/ and experiments/ are
# described as a whole: one module per command, the sandbox, one module per experiment)
LISTED_FOLDERS = ("attention", "engine", "generation", "training", "interop", "explore", "hooks", "circuits")


def _tree(document: Path) -> str:
    """The ```text block of ``document`` that starts with ``src/tformer/``: its package tree."""
    return document.read_text(encoding="utf-8").split("```text\nsrc/tformer/\n", 1)[1].split("```", 1)[0]


def test_the_readme_package_tree_names_every_module_of_the_listed_folders():
    # README's layout is a few lines: every top-level module and folder of the package, by name
    root = PACKAGE.parents[1]
    readme = _tree(root / "README.md")
    tops = sorted({relative(p).split("/")[0] for p in MODULES} - {"__init__.py", "__main__.py"})
    names = [top if top.endswith(".py") else f"{top}/" for top in tops]
    missing = [name for name in names if not re.search(rf"(?<![\w/]){re.escape(name)}(?![\w])", readme)]
    assert not missing, f"top-level modules and folders not named in README's 'What is inside': {missing}"
    # docs/model.md's tree (the full layout, which README links to) names every module of the listed folders
    tree = _tree(root / "docs" / "model.md")
    named = set(re.findall(r"\w+\.py", tree))
    modules = [relative(p) for p in MODULES if p.name not in ("__init__.py", "__main__.py")]
    listed = [m for m in modules if "/" not in m or m.split("/")[0] in LISTED_FOLDERS]
    missing = [m for m in listed if Path(m).name not in named]
    assert not missing, f"modules not named in the package tree of docs/model.md: {missing}"


CPP_LINE_BUDGET = 600  # the C++ kernels are split by instruction-set family (engine/kernels/README.md)


def test_no_kernel_source_outgrows_its_budget_or_reads_an_experiment_switch():
    sources = sorted(p for pattern in ("*.cpp", "*.h") for p in PACKAGE.rglob(pattern))
    assert sources, "no C++ sources found"
    over = {relative(p): n for p in sources if (n := len(p.read_text().splitlines())) > CPP_LINE_BUDGET}
    assert not over, f"over {CPP_LINE_BUDGET} lines: {over}"
    # every TFORMER_ macro the sources test is one they define from the compiler's feature macros: none is a knob
    # set from outside (-DTFORMER_...), which would be a second build of the same kernels to keep working
    text = "\n".join(p.read_text() for p in sources)
    tested = set(re.findall(r"#\s*(?:if|ifdef|ifndef|elif)\b[^\n]*", text))
    used = {name for line in tested for name in re.findall(r"\bTFORMER_\w+", line)}
    defined = set(re.findall(r"#\s*define\s+(TFORMER_\w+)", text))
    assert used <= defined, f"macros read but never defined (outside knobs): {sorted(used - defined)}"


def _files_run(model, ids) -> set[str]:
    """The package's files whose functions run during ``model(ids)``."""
    import sys

    files = set()

    def note(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            files.add(relative(Path(frame.f_code.co_filename)))

    sys.setprofile(note)
    try:
        model(ids)
    finally:
        sys.setprofile(None)
    return files


def test_ids_to_logits_is_read_in_the_core_files_alone():
    """A newcomer traces a decoder-only LM from ids to logits in four files of the core (a fifth with RoPE: its
    rotation is functional.py's formula), and nothing of the engine runs in a plain model."""
    import torch

    from tformer import DecoderLM, TransformerConfig

    ids = torch.randint(0, TransformerConfig.tiny().vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    core = {"models.py", "layers.py", "positions.py", "attention/__init__.py"}
    gpt = DecoderLM(TransformerConfig.tiny(position="learned")).eval()
    assert _files_run(gpt, ids) == core
    llama = DecoderLM(TransformerConfig.tiny(position="rotary", norm="rms", ffn="gated", activation="silu")).eval()
    assert _files_run(llama, ids) == core | {"functional.py"}
