"""`experiments/evidence.py`: the evidence index and page are what it writes from today's results, every registered
method has a row, and its verdict rule reads criteria as documented."""

import io
import json
import sys
from pathlib import Path

import pytest
import yaml


REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import evidence  # noqa: E402


def test_committed_index_and_page_are_generated_from_todays_results():
    index = evidence.build_index()
    committed = json.loads(evidence.INDEX.read_text())
    assert committed == json.loads(json.dumps(index, ensure_ascii=False)), "run: python experiments/evidence.py"
    assert evidence.PAGE.read_text() == evidence.page(index), "run: python experiments/evidence.py"


def test_each_family_page_links_its_methods_rows():
    index = json.loads(evidence.INDEX.read_text())
    assert set(evidence.FAMILY_PAGE) == set(index)
    for name in set(evidence.FAMILY_PAGE.values()):
        text = (evidence.PAGE.parent / name).read_text()
        assert text.count(evidence.BEGIN) == 1, f"docs/{name}: run python experiments/evidence.py"
        assert evidence.with_block(text, evidence.page_block(index, name)) == text, name
        for family, methods in index.items():
            if evidence.FAMILY_PAGE[family] == name:
                for method in methods:
                    assert f"(evidence.md#{evidence.anchor(family, method)})" in text


def test_every_registered_method_has_a_row_and_mergekits_are_those_checked_against_mergekit():
    from hf_stable.registry import list_methods

    listing = list_methods(file=io.StringIO())
    recipes = sorted((REPO / "tests" / "merging" / "mergekit_parity" / "recipes").rglob("*.yml"))
    recipes += sorted((REPO / "tests" / "merging" / "mergekit_parity" / "recipes").rglob("*.yaml"))
    checked = {yaml.safe_load(p.read_text()).get("merge_method") for p in recipes} - {None}
    assert checked == set(evidence.MERGEKIT_CHECKED)
    index = json.loads(evidence.INDEX.read_text())
    for family, names in listing.items():
        for name in names:
            if family == "merge_method" and name in evidence.MERGEKIT_CHECKED:
                continue
            assert name in index.get(family, {}), f"{family}/{name} has no row in experiments/evidence.py ROWS"
    rows = [(r.family, r.name) for r in evidence.ROWS]
    assert len(rows) == len(set(rows))


def test_verdicts_are_valid_and_experiments_exist():
    index = json.loads(evidence.INDEX.read_text())
    for family, methods in index.items():
        for name, row in methods.items():
            assert row["verdict"] in evidence.VERDICTS, (family, name)
            assert {"experiment", "verdict", "effect", "ci_low", "ci_high", "control_passed"} <= set(row)
            if row["verdict"] in ("replicated", "not replicated", "inconclusive"):
                assert (evidence.RESULTS / f"{row['experiment']}.json").exists()
            if row["verdict"] == "not replicated":
                assert row["control_passed"] is True, (family, name)  # a failure counts only where it could show


def _result(**passed):
    return {"criteria": {k: {"passed": v, "criterion": k, "values": {}} for k, v in passed.items()}}


@pytest.mark.parametrize(
    "passed, claim, controls, expected",
    [
        ({"a": True, "c": True}, ("a",), ("c",), ("replicated", True)),
        ({"a": False, "c": True}, ("a",), ("c",), ("not replicated", True)),
        ({"a": True, "c": False}, ("a",), ("c",), ("inconclusive", False)),  # a failed control: nothing to read
        ({"a": False}, ("a",), (), ("inconclusive", None)),  # no control: a failure says nothing
        ({"a": True, "b": False}, ("a", "b"), (), ("inconclusive", None)),
        ({"a": True, "b": True}, ("a", "b"), (), ("replicated", None)),
    ],
)
def test_criteria_verdict_rule(passed, claim, controls, expected):
    assert evidence._criteria_verdict(_result(**passed), claim, controls) == expected


def test_criteria_verdict_names_a_missing_criterion():
    with pytest.raises(KeyError, match="'z'"):
        evidence._criteria_verdict(_result(a=True), ("a", "z"), ())


def test_page_links_each_row_to_its_section():
    index = json.loads(evidence.INDEX.read_text())
    text = evidence.PAGE.read_text()
    for family, methods in index.items():
        for name, row in methods.items():
            assert f'<a id="{evidence.anchor(family, name)}"></a>' in text
            if row["experiment"]:
                assert f"(#{evidence.anchor(family, name)})" in text
