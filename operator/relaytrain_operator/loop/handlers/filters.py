"""Which objects the handlers serve: those in the namespaces `--namespace` names.

With globs the operator watches the whole cluster (see __main__) and every namespaced
handler filters by `OperatorOptions.serves`; with plain names or none, kopf watches only
what is served and the filter passes everything.
"""

from __future__ import annotations

from typing import Any


def served(namespace: str | None, memo: Any, **_: Any) -> bool:
    """kopf's `when=` filter: the object's namespace is one this operator serves."""
    return bool(memo.options.serves(namespace))
