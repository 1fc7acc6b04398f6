"""Tables render once into aligned text and HTML."""

from torch_device_magic.reports import Table


def test_columns_align_and_numbers_are_right_aligned():
    table = Table("title", ["name", "bytes"], [["a", "1.0 KiB"], ["long name", "12.5 MiB"]])
    lines = table.text().splitlines()
    assert lines[0] == "title"
    assert lines[3].endswith(" 1.0 KiB") and lines[4].endswith("12.5 MiB")
    assert len({len(line) for line in lines[1:]}) == 1


def test_a_table_without_rows_is_its_title_and_notes_alone():
    table = Table("nothing to move to cpu", ["name", "bytes"], [], ["a note"])
    assert table.text() == "nothing to move to cpu\na note"
    assert "<table>" not in table.html() and "nothing to move to cpu" in table.html()


def test_html_escapes_and_offers_both_mimetypes():
    bundle = Table("<t>", ["h"], [["<b>x</b>"]])._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert "&lt;b&gt;x&lt;/b&gt;" in bundle["text/html"] and "<b>x</b>" in bundle["text/plain"]


def test_html_carries_its_alignment_text_left_and_numbers_right():
    # Jupyter's CSS right-aligns every table cell: ours says its own alignment.
    markup = Table("t", ["name", "bytes"], [["model", "1.0 KiB"]]).html()
    assert '<th style="text-align:left">name</th><th style="text-align:right">bytes</th>' in markup
    assert '<td style="text-align:left">model</td><td style="text-align:right">1.0 KiB</td>' in (
        markup)
