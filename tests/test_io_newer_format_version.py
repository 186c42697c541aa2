"""A checkpoint (file or state dict) of a later format version says that a newer qstats wrote it;
other unknown versions do not."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import qstats
from qstats import io as qio


def _rewritten(tmp_path, version):
    path = tmp_path / "stats.safetensors"
    qstats.save(path, {"layer": torch.ones(2)})
    with safe_open(str(path), "pt") as handle:  # an independent writer, as a later qstats would use
        metadata, tensors = handle.metadata(), {key: handle.get_tensor(key) for key in handle.keys()}
    metadata["format_version"] = version
    out = tmp_path / f"v{version}.safetensors"
    save_file(tensors, str(out), metadata=metadata)
    return out


@pytest.mark.parametrize("version", [str(qio.FORMAT_VERSION + 1), "10"])
def test_a_later_version_names_a_newer_qstats(tmp_path, version):
    with pytest.raises(ValueError, match=f"format version '{version}'.*newer qstats; upgrade qstats"):
        qstats.load(_rewritten(tmp_path, version))
    state_dict = dict(qio.to_state_dict({"layer": torch.ones(2)}), format_version=int(version))
    with pytest.raises(ValueError, match="newer qstats"):
        qio.from_state_dict(state_dict)


@pytest.mark.parametrize("version", ["0", "1.5", "abc"])
def test_other_unknown_versions_do_not_claim_a_newer_qstats(tmp_path, version):
    with pytest.raises(ValueError, match=f"format version '{version}'") as info:
        qstats.load(_rewritten(tmp_path, version))
    assert "newer" not in str(info.value)
