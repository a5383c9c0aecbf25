"""A script that makes a multi-rank Engine at its unguarded top level is refused with what to do,
before any rank starts (each spawned rank would run the script's top level again)."""

import subprocess
import sys
import textwrap

import pytest

from ringctx.engine.workers import _under_main_guard

UNGUARDED = """\
import ringctx

engine = ringctx.Engine("tiny", nproc=2, dtype="float32")
print(engine.prefill(list(range(20))).logits.shape)
"""

GUARDED = """\
import ringctx


def main():
    with ringctx.Engine("tiny", nproc=2, dtype="float32") as engine:
        print("logits", tuple(engine.prefill(list(range(20))).logits.shape))


if __name__ == "__main__":
    main()
"""


def run_script(tmp_path, text):
    path = tmp_path / "script.py"
    path.write_text(text)
    return path, subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300,
                                cwd=tmp_path)


def test_an_unguarded_script_is_refused_naming_the_line_and_the_fix(tmp_path):
    path, done = run_script(tmp_path, UNGUARDED)
    assert done.returncode != 0
    assert f"{path}, line 3: an Engine with nproc=2 is made at the script's top level" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert "exited with code" not in done.stderr  # refused before any rank started


def test_a_guarded_script_runs(tmp_path):
    _, done = run_script(tmp_path, GUARDED)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "logits (256,)" in done.stdout


@pytest.mark.parametrize("source, line, guarded", [
    ("x = 1\nif __name__ == '__main__':\n    y = 2\n    z = 3\n", 4, True),
    ("x = 1\nif '__main__' == __name__:\n    y = 2\n", 3, True),
    ("x = 1\nif __name__ == '__main__':\n    y = 2\nz = 3\n", 4, False),
    ("x = 1\nif __name__ != '__main__':\n    y = 2\n", 3, False),
    ("x = 1\n", 1, False),
])
def test_the_guard_is_read_from_the_script(tmp_path, source, line, guarded):
    path = tmp_path / "s.py"
    path.write_text(textwrap.dedent(source))
    assert _under_main_guard(str(path), line) is guarded


def test_the_readme_example_keeps_its_engine_under_the_guard(tmp_path):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("\n# The core", 1)[0]
    path = tmp_path / "example.py"
    path.write_text(example)
    line = next(i for i, text in enumerate(example.splitlines(), start=1) if "ringctx.Engine(" in text)
    assert _under_main_guard(str(path), line)
