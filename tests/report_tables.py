"""report.md's tables read back, for the report tests: {section heading: {row label: {column: cell}}}."""


def markdown_tables(md: str, two_column_labels=()) -> dict:
    """Rows are labelled by their first cell, or by their first two in the sections named in
    `two_column_labels` (a stage-1 table's (arm, lr))."""
    tables, heading, header = {}, None, None
    for line in md.splitlines():
        if line.startswith(("## ", "### ")):
            heading, header = line.lstrip("#")[1:], None
        elif line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if header is None:
                header = cells
            else:
                key = (cells[0], cells[1]) if heading in two_column_labels else cells[0]
                tables.setdefault(heading, {})[key] = dict(zip(header, cells))
    return tables
