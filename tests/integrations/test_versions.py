"""An integration imported beside a framework release it cannot work with says so, naming both releases."""

import os

import pytest

from toma.integrations.versions import require

from helpers import REPO


@pytest.mark.parametrize("found", ["5.23.0", "5.24.1", "6.0.0.dev0", "5.23.0rc1"])
def test_a_release_at_or_above_the_minimum_passes(found):
    require("transformers", found, "5.23", "transformers")


@pytest.mark.parametrize("found", ["5.17.0", "4.57.1", "5.22.9"])
def test_an_older_release_is_an_import_error_naming_the_package_both_releases_and_the_extra(found):
    with pytest.raises(ImportError) as raised:
        require("transformers", found, "5.23", "transformers")
    message = str(raised.value)
    assert "transformers >= 5.23" in message and f"found {found}" in message and "toma[transformers]" in message


def test_the_transformers_integration_states_its_minimum_and_the_extra_installs_it():
    transformers = pytest.importorskip("transformers", minversion="5.23")
    from toma.integrations import transformers as integration

    with open(os.path.join(REPO, "setup.cfg"), encoding="utf-8") as file:
        setup = file.read()
    assert integration.MINIMUM_TRANSFORMERS == "5.23" and f"transformers>={integration.MINIMUM_TRANSFORMERS}" in setup
    assert transformers.__version__
