"""A new user's first hour (tester report 61): a drafter path that is not there is said to be
missing, for heads as for the target and a draft model (it had read "no config.json (expected a
heads folder ...)" / "not an EAGLE-3 folder", as if the folder were there in another format)."""

from __future__ import annotations

import pytest

from specdec import LLM
from specdec.defaults import BUNDLED_TARGET
from specdec.model import CheckpointError


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
@pytest.mark.parametrize("path,said", [("yuhuili/EAGLE-not-cached", "is not in the local cache"),
                                       ("/nonexistent/heads", "does not exist")])
def test_a_missing_drafter_folder_is_said_to_be_missing(method, path, said):
    with pytest.raises(CheckpointError, match=said):
        LLM(BUNDLED_TARGET, speculative_config={"method": method, "model": path, "num_speculative_tokens": 2})
