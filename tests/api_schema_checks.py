"""A schemathesis check for ``tests/test_api_schema.py`` (loaded by the schemathesis CLI as its
hooks module, not by pytest).

A batch the OpenAPI document calls valid may still be refused with a 422 ``inconsistent_record``
for what no schema can state: a rank past its incarnation's declared world size, an
acknowledgement of a directive the run does not have, a manifest digest that is not the
manifest's. The test lets ``positive_data_acceptance`` take a 422 from that one operation; this
check fails any other 422 there on a batch generated as valid (an ``invalid_record``: the
document and the models disagree).
"""

from __future__ import annotations

from typing import Any

import schemathesis

RECORDS = "POST /v1/runs/{run}/records"


@schemathesis.check
def only_inconsistent_records_refused(ctx: Any, response: Any, case: Any) -> bool | None:
    """A valid batch is refused with 422 only as ``inconsistent_record``."""
    if case.operation.label != RECORDS or response.status_code != 422:
        return None
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return None
    error = response.json().get("error")
    if error != "inconsistent_record":
        raise AssertionError(f"a batch valid by the document was refused as {error!r}: {response.text}")
    return None
