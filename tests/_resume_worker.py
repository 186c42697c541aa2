"""The model, data and recipe of tests/test_resume.py, and its second-process half.

Run as ``python tests/_resume_worker.py IN OUT``: a fresh interpreter loads the states saved by
the test (``qstats.load(IN)``), calibrates the second half of the batches from them
(``qstats.calibrate(..., states=loaded)``) and saves the result (``qstats.save(OUT)``).
"""

from __future__ import annotations

import sys

import torch

import qstats

NUM_BATCHES = 6


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 24)
        self.fc2 = torch.nn.Linear(24, 16)
        self.fc3 = torch.nn.Linear(16, 8)

    def forward(self, x, mask):
        del mask  # only used as the observation weight
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_model() -> Tiny:
    torch.manual_seed(0)
    return Tiny().eval()


def make_batches():
    """Padded batches ``{"x": (B, T, 16), "mask": (B, T)}``: padding positions are not observed."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(NUM_BATCHES):
        x = torch.randn(2, 5, 16, generator=g) * (1 + i % 3)
        mask = (torch.arange(5)[None, :] < torch.tensor([[5], [2 + i % 3]])).to(torch.float32)
        x = x + 100.0 * (1 - mask)[..., None]  # padding would change every range if observed
        out.append({"x": x, "mask": mask})
    return out


def _histogram_kwargs():
    """Small histograms (16 buckets per octave, 16 octaves), in the factory's own parameters, and
    the options compute_qparams then needs."""
    import inspect

    if "octaves" in inspect.signature(qstats.histogram).parameters:
        return {"buckets_per_octave": 16, "octaves": 16}, {}
    config = {"bins": 16, "exponent_range": (-8, 8)}
    return config, config


def make_recipe() -> qstats.Recipe:
    histogram_config, histogram_options = _histogram_kwargs()
    weight = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    activation = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
    return qstats.Recipe(
        [
            qstats.Rule(targets="fc1", sites=("input",), observer=qstats.minmax, spec=activation),
            qstats.Rule(
                targets="fc2",
                sites=("input",),
                observer=qstats.moving_average_minmax,
                spec=activation,
                observer_kwargs={"averaging_constant": 0.1},
            ),
            qstats.Rule(
                targets="fc3",
                sites=("input",),
                observer=qstats.histogram,
                spec=activation,
                observer_kwargs=histogram_config,
                qparams_kwargs=histogram_options,
            ),
            qstats.Rule(targets="Linear", sites=("weight",), observer=qstats.minmax, spec=weight),
        ]
    )


def calibrate(batches, states=None):
    return qstats.calibrate(
        make_model(), batches, make_recipe(), states=states, progress=False, observation_weight=lambda b: b["mask"]
    )


def main(path_in: str, path_out: str) -> None:
    loaded = qstats.load(path_in)
    second = make_batches()[NUM_BATCHES // 2 :]
    qstats.save(path_out, calibrate(second, states=loaded))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
