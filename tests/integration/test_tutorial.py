"""examples/tutorial.py runs end to end and prints what the tutorial says it prints."""
import re
import subprocess
import sys
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[2] / "examples" / "tutorial.py"


def test_tutorial_prints_the_documented_output():
    out = subprocess.run([sys.executable, str(TUTORIAL)], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[:4] == ["torch.Size([32, 10])", "True True", "True", "True"], out.stdout
    timing = re.compile(r"^(PyTorch|drop-in kernels|torch\.compile): +\d+\.\d\d ms$")
    assert len(lines) == 7 and all(timing.match(line) for line in lines[4:]), out.stdout
