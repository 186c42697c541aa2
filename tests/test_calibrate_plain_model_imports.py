"""Calibrating a plain nn.Module does not import transformers (before: the recipe's checkpoint-name
lookup imported it, and transformers imports torchao: about 3 s on the first calibrate, and torchao's
"Failed to load" lines printed for a model that is neither's)."""

import subprocess
import sys

_SCRIPT = """
import sys, torch, qstats
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"), spec=qstats.QuantSpec(dtype="int8"))])
states = qstats.calibrate(model, [torch.randn(2, 8)], recipe, progress=False)
qparams = qstats.compute_qparams_tree(states, recipe, model)
with qstats.fake_quantized(model, qparams, recipe):
    model(torch.randn(2, 8))
print(sorted(name for name in ("transformers", "torchao") if name in sys.modules))
"""


def test_calibrating_a_plain_module_imports_neither_transformers_nor_torchao():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
