"""Samples of an engine's Prometheus text page (`/metrics`), read without a full parse."""

from __future__ import annotations


def sum_series(text: str, name: str, dp_rank: int, label: str = "") -> float | None:
    """The sum of series `name`'s samples for `dp_rank`, only those whose labels contain
    `label` (e.g. 'source="host"') when it is given; None when there is none.

    Samples carrying an `engine` label count only for that rank; samples without one count for
    any rank. Series are summed over other labels (model_name). Only `name` is looked up
    (str.find), so a large page costs little."""
    total: float | None = None
    rank_label = f'engine="{dp_rank}"'
    start = 0
    while True:
        at = text.find(name, start)
        if at < 0:
            return total
        start = at + len(name)
        if at > 0 and text[at - 1] != "\n":
            continue  # inside a comment or another series' name
        end = text.find("\n", start)
        line = text[start : end if end >= 0 else len(text)]
        if line[:1] == "{":
            close = line.find("}")
            labels = line[1:close]
            value_text = line[close + 1 :]
            if ('engine="' in labels and rank_label not in labels) or label not in labels:
                continue
        elif line[:1] == " " and not label:
            value_text = line
        else:
            continue  # a longer name with this prefix (e.g. _total, _bucket)
        try:
            value = float(value_text.split()[0])
        except (ValueError, IndexError):
            continue
        total = value if total is None else total + value
