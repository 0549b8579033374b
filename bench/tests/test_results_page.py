"""docs/results.md's generated headline table (bench/results_page.py): the page matches what the results
folders' headline.json say, every row's study page and results folder exist, the study pages' links
resolve, and the generator refuses stale pages and malformed headlines."""
import glob
import json
import os
import re

import pytest

from bench import results_page
from bench.results_page import BEGIN, END, ROOT

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
STUDIES = sorted(glob.glob(os.path.join(ROOT, "docs", "studies", "*.md")))


def _anchor(heading):
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _without_code(text):
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _broken_links(page):
    with open(page) as f:
        text = _without_code(f.read())
    broken = []
    for link in LINK.findall(text):
        if re.match(r"^[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
        if not os.path.exists(path):
            broken.append(f"{link}: no such file")
        elif anchor and path.endswith(".md"):
            with open(path) as f:
                headings = re.findall(r"^#+\s+(.*)$", _without_code(f.read()), re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(f"{link}: no heading #{anchor}")
    return broken


def test_results_page_is_up_to_date():
    current, expected = results_page.expected_page()
    assert current == expected, "docs/results.md is out of date: run python -m bench.results_page"
    assert results_page.main(["--check"]) == 0


def _tables():
    """(the at-a-glance rows, every figure's rows) of docs/results.md's generated part."""
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        text = f.read()
    glance, every = text[text.index(BEGIN):text.index(END)].split(f"### {results_page.EVERY_FIGURE}")
    return [[line for line in part.splitlines() if line.startswith("| ") and not line.startswith(header)]
            for part, header in ((glance, "| study"), (every, "| measure"))]


def _assert_links_exist(rows, study=False):
    docs = os.path.join(ROOT, "docs")
    for row in rows:
        links = LINK.findall(row)
        assert any("/bench/results/" in link for link in links), row
        assert not study or any(link.startswith("studies/") for link in links), row
        for link in links:
            assert os.path.exists(os.path.normpath(os.path.join(docs, link))), f"{link} in {row}"


def test_every_row_links_a_study_page_and_a_results_folder_that_exist():
    glance, every = _tables()
    headlines = results_page.load_headlines()
    assert len(every) == sum(len(h["rows"]) for _, h in headlines) >= 15
    _assert_links_exist(every)
    _assert_links_exist(glance, study=True)


def test_the_page_opens_with_one_figure_per_study_on_one_screen():
    glance, _ = _tables()
    pages = {h["page"] for _, h in results_page.load_headlines() if h["page"]}
    linked = [re.search(r"\(studies/([^)]+)\)", row).group(1) for row in glance]
    assert sorted(linked) == sorted(os.path.basename(p) for p in pages)       # each study once
    assert len(glance) <= 30


@pytest.mark.parametrize("page", STUDIES, ids=os.path.basename)
def test_study_page_links_resolve(page):
    assert not _broken_links(page)


def test_every_study_page_is_listed_on_the_results_page():
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        text = f.read()
    assert STUDIES
    missing = [os.path.basename(p) for p in STUDIES if f"(studies/{os.path.basename(p)})" not in text]
    assert not missing


def test_headline_dates_are_the_dates_of_the_folders_manifests():
    for name, headline in results_page.load_headlines():
        folder = os.path.join(ROOT, "bench", "results", name)
        dates = set()
        for manifest in glob.glob(os.path.join(folder, "**", "manifest.json"), recursive=True):
            with open(manifest) as f:
                dates.add(str(json.load(f).get("date", ""))[:10])
        assert headline["date"] in dates, f"{name}: headline date {headline['date']}, manifests {sorted(dates)}"


def _tree(tmp_path):
    """A repository in miniature: a results page with the markers, a study page, one results folder."""
    (tmp_path / "docs" / "studies").mkdir(parents=True)
    (tmp_path / "docs" / "studies" / "s.md").write_text("# A study\n\nbench/results/b/ then bench/results/a/\n")
    (tmp_path / "docs" / "results.md").write_text(f"# Results\n\nintro\n\n{BEGIN}\n{END}\n\n## Studies\n")
    for name in ("a", "b"):
        (tmp_path / "bench" / "results" / name).mkdir(parents=True)
        (tmp_path / "bench" / "results" / name / "headline.json").write_text(json.dumps({
            "title": f"run {name}", "date": "2026-11-20", "page": "docs/studies/s.md",
            "rows": [{"measure": f"step time {name}", "value": "1.0x", "setup": "cnn | 2 ranks"}]}))
    return tmp_path


def test_check_fails_on_a_stale_page_and_passes_once_rewritten(tmp_path):
    root = _tree(tmp_path)
    assert results_page.main(["--check"], root=str(root)) == 1
    assert results_page.main([], root=str(root)) == 0
    assert results_page.main(["--check"], root=str(root)) == 0
    text = (root / "docs" / "results.md").read_text()
    assert text.startswith("# Results\n\nintro\n") and text.endswith(f"{END}\n\n## Studies\n")
    # rows in the order the study page cites the folders; a pipe in a cell is escaped
    assert text.index("step time b") < text.index("step time a")
    assert "cnn \\| 2 ranks" in text and "[A study](studies/s.md)" in text and "[a](../bench/results/a/)" in text
    # at a glance: the study once, with the first row of the folder it cites first
    glance = text[:text.index(results_page.EVERY_FIGURE + "\n")]
    assert glance.count("[A study](studies/s.md)") == 1
    assert "step time b: 1.0x" in glance and "step time a" not in glance
    headline = root / "bench" / "results" / "a" / "headline.json"
    headline.write_text(headline.read_text().replace("1.0x", "2.0x"))
    assert results_page.main(["--check"], root=str(root)) == 1


def test_a_page_without_the_markers_is_refused(tmp_path):
    root = _tree(tmp_path)
    (root / "docs" / "results.md").write_text("# Results\n")
    with pytest.raises(ValueError, match="marker"):
        results_page.main(["--check"], root=str(root))


@pytest.mark.parametrize("field, value", [("date", "26.11.2026"), ("page", "docs/studies/none.md"),
                                          ("rows", []), ("title", "two\nlines")])
def test_a_malformed_headline_names_its_field(tmp_path, field, value):
    root = _tree(tmp_path)
    path = root / "bench" / "results" / "a" / "headline.json"
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=repr(field) if field != "rows" else "'rows'"):
        results_page.read_headline(str(path), root=str(root))


def test_a_row_without_its_value_names_it(tmp_path):
    root = _tree(tmp_path)
    path = root / "bench" / "results" / "a" / "headline.json"
    data = json.loads(path.read_text())
    del data["rows"][0]["value"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"rows\[0\]\.value"):
        results_page.load_headlines(str(root))


def test_unknown_arguments_are_refused():
    assert results_page.main(["--write"]) == 2
