"""docs/config.md is what areal_hpc/config/__init__.py's comments generate, and every key has a description."""

from __future__ import annotations

import pytest

from areal_hpc.config import reference as config_reference
from areal_hpc.config.reference import COMMAND, PAGE, describe


def test_the_config_page_is_up_to_date():
    fresh = config_reference.page()  # also fails, naming the key, if a field has no comment
    if PAGE.read_text() != fresh:
        pytest.fail(f"docs/config.md is out of date with areal_hpc/config/__init__.py: run `{COMMAND}`", pytrace=False)


def test_a_field_is_described_by_the_comments_above_it_and_on_its_line():
    source = '''
class S:
    """A section."""

    a: int = 1  # on its line
    # above, first line
    # above, second line
    b: str = "x"  # and on its line
    c: float = 0.5
'''
    doc, fields = describe(source)["S"]
    assert doc == "A section."
    assert fields["a"] == ("int", "on its line")
    assert fields["b"] == ("str", "above, first line above, second line and on its line")
    assert fields["c"] == ("float", "")


def test_a_key_without_a_description_stops_the_page_naming_it(monkeypatch):
    real = config_reference.describe

    def without_one(source):
        docs = real(source)
        if "SlurmConfig" in docs:  # config/cluster.py's classes
            docs["SlurmConfig"][1]["venv"] = ("str", "")
        return docs

    monkeypatch.setattr(config_reference, "describe", without_one)
    with pytest.raises(ValueError, match=r"^slurm\.venv has no comment in its config dataclass"):
        config_reference.page()
