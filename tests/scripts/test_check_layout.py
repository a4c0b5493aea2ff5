"""scripts/check_layout.py finds a file past 1,000 lines, a test outside its package's folder, an import
cycle and an import against the layers."""

from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
check_layout = load_script("check_layout")


def _tree(root: Path, files: dict[str, int]) -> None:
    for name, lines in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n" * lines)


def test_this_repository_keeps_the_rules():
    assert check_layout.main(ROOT) == 0


def test_a_long_file_and_misplaced_tests_are_named(tmp_path, capsys):
    _tree(
        tmp_path,
        {
            "experiments/__init__.py": 1,
            "experiments/run.py": 10,
            "serving/__init__.py": 1,
            "serving/router/policy.py": 801,
            "tests/experiments/test_run_faults.py": 5,  # named after experiments/run.py: in place
            "serving/router/__init__.py": 1,
            "tests/serving/test_policy_admission.py": 5,  # serving/router/policy.py's: misplaced
            "tests/nowhere/test_x.py": 5,  # no package nowhere/
            "tests/serving/router/test_policy.py": 800,  # in place, and no warning at 800 lines
        },
    )
    assert check_layout.main(tmp_path) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "warning: serving/router/policy.py: 801 lines (past 800: look for a seam)",
        "tests/nowhere/test_x.py: tests/nowhere mirrors no package (nowhere does not exist)",
        "tests/serving/test_policy_admission.py: tests serving/router/policy.py: belongs in "
        "tests/serving/router/",
    ]


def test_an_import_cycle_is_named_even_through_a_function_level_import(tmp_path):
    for name, text in {
        "engine/__init__.py": "from engine.llm import LLM\n",
        "engine/llm.py": "from engine import dp\nLLM = 1\n",
        "engine/dp.py": "def main():\n    from .group import run\n",
        "engine/group.py": "from engine.llm import LLM\nrun = 2\n",
        "engine/typed.py": "import typing\nif typing.TYPE_CHECKING:\n    from engine.llm import LLM\n",
        "engine/model.py": "from engine import mla\n",  # the module engine.mla, not the package
        "engine/mla.py": "x = 1\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert check_layout.import_cycles(tmp_path) == ["an import cycle: engine.dp, engine.group, engine.llm"]
    (tmp_path / "engine/dp.py").write_text("def main():\n    import importlib\n")  # no import of the group
    assert check_layout.import_cycles(tmp_path) == []
    for call in (
        'importlib.import_module("engine.group")',
        'import_module("engine.group")',
        '__import__("engine.group")',
    ):
        (tmp_path / "engine/dp.py").write_text(f"import importlib\ndef main():\n    {call}.run()\n")
        assert check_layout.import_cycles(tmp_path) == [
            "an import cycle: engine.dp, engine.group, engine.llm"
        ], call
    (tmp_path / "engine/dp.py").write_text(
        "import importlib\ndef main(name):\n    importlib.import_module(name)\n"
    )
    assert check_layout.import_cycles(tmp_path) == []  # a name known only when it runs: not a literal target


def test_a_long_file_alone_warns_and_passes(tmp_path, capsys):
    _tree(tmp_path, {"engine/__init__.py": 1, "engine/llm.py": 900})
    assert check_layout.main(tmp_path) == 0
    assert capsys.readouterr().out.splitlines() == [
        "warning: engine/llm.py: 900 lines (past 800: look for a seam)"
    ]


def test_an_import_against_the_layers_is_named(tmp_path):
    """serving never imports the main job (experiments), the engine never imports serving: each package
    imports only those after it in LAYERS."""
    for name, text in {
        "experiments/run.py": "from serving import runtime\n",  # down: allowed
        "serving/__init__.py": "",
        "serving/runtime.py": "from engine import llm\n",  # down: allowed
        "serving/router/policy.py": "def f():\n    from experiments import run\n",  # up, inside a function
        "engine/llm.py": "import serving.router.policy\n",  # up
        "transfer/plan.py": "import pdkernels.ops\n",
        "pdkernels/ops.py": "x = 1\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert check_layout.upward_imports(tmp_path) == [
        "engine.llm imports serving.router.policy: engine may import only transfer, pdkernels",
        "serving.router.policy imports experiments.run: serving may import only engine, transfer, pdkernels",
    ]


def test_a_role_compared_by_its_name_is_named(tmp_path):
    """A worker's role is a Role: comparing something named role with a role's name is a breach; the
    same names in other settings (a message's role, a simulator option) are not."""
    for name, text in {
        "serving/worker.py": 'def f(s, m):\n    return s.role != "prefill" or m.role in ("decode", "x")\n',
        "serving/http/fields.py": 'def g(role):\n    return role == "assistant"\n',
        "experiments/sim/simulate.py": 'def h(router):\n    return router == "decode"\n',
        "engine/llm.py": "def k(role):\n    return role.sends_kv\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert [line.split(": ", 1)[0] for line in check_layout.role_names(tmp_path)] == [
        "serving/worker.py:2",
        "serving/worker.py:2",
    ]
