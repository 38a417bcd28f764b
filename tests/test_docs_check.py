"""The docs' predicted figures against the commands quoted beside them (tools/docs_check.py):
the mechanism on a small file (a changed figure fails, --update rewrites it), then every
marked figure of README.md and docs/*.md, rerun."""
import os

import pytest

from tools import docs_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOC = """Run it:
<!-- docs-check demo: python -c "print('tokens 1234567, memory 71.96 GB')" -->
It prints **1,234,567**<!-- demo /tokens (\\d+)/ :,d --> tokens in
71.96<!-- demo /memory ([\\d.]+) GB/ --> GB, about 72.0<!-- demo /memory ([\\d.]+) GB/ :.1f --> GB
or 1.23<!-- demo /tokens (\\d+)/ /1e6:.2f -->M tokens. The whole line:

<!-- docs-check-lines demo /^tokens/ -->
```
tokens 1234567, memory 71.96 GB
```
"""


@pytest.mark.quick
def test_matching_figures_pass(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text(DOC)
    assert docs_check.check([str(doc)]) == []


def test_a_changed_figure_fails_and_update_rewrites_it(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text(DOC.replace("**1,234,567**", "**1,234,000**").replace("72.0<", "71.9<"))
    diffs = docs_check.check([str(doc)])
    assert len(diffs) == 2
    assert diffs[0].endswith(":3: quotes 1,234,000, `demo` prints 1,234,567"), diffs
    assert ":4: quotes 71.9, `demo` prints 72.0" in diffs[1], diffs
    assert docs_check.main([str(doc)]) == 1
    assert docs_check.check([str(doc)], update=True) == diffs
    assert doc.read_text() == DOC
    assert docs_check.main([str(doc)]) == 0


def test_a_figure_naming_no_command_is_an_error(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("It fits 12<!-- nowhere /x (\\d+)/ --> tokens.\n")
    with pytest.raises(SystemExit, match="a.md:1: figure names 'nowhere'"):
        docs_check.check([str(doc)])


def test_a_regex_the_output_lacks_is_an_error(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text(DOC.replace("/memory ([\\d.]+) GB/ -->", "/peak ([\\d.]+) GB/ -->"))
    with pytest.raises(SystemExit, match="matches nothing in the output"):
        docs_check.check([str(doc)])


@pytest.mark.slow
def test_the_docs_quote_what_their_commands_print():
    """The planner's predictions in README.md and docs/*.md (each command once, in this
    process). A planner change that moves a figure fails here: `make docs-check UPDATE=1`
    writes the new figures."""
    paths = docs_check.default_paths()
    n = sum(len(docs_check.parse(p, open(p).read())[1]) for p in paths)
    assert n >= 40  # README's headline and docs/memory.md's every figure are marked
    assert docs_check.check(paths) == []


def test_a_changed_line_of_quoted_output_fails_and_update_rewrites_it(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text(DOC.replace("tokens 1234567, memory 71.96 GB\n", "tokens 1, memory 1 GB\n"))
    diffs = docs_check.check([str(doc)])
    assert len(diffs) == 1 and diffs[0].endswith(
        "a.md:9: quotes tokens 1, memory 1 GB, `demo` prints tokens 1234567, memory 71.96 GB"
    ), diffs
    docs_check.check([str(doc)], update=True)
    assert doc.read_text() == DOC
