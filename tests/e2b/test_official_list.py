"""The official SDK's `Sandbox.list` against hutch as against E2B: newest first unless
asked otherwise, paged by X-Next-Token across running and paused sandboxes, filtered by
state, metadata, start time and template (issue 12, item 10)."""

from datetime import timedelta

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState


def every_page(query, limit, order=None):
    """The ids on each page the SDK's paginator fetches, in order."""
    paginator = Sandbox.list(query=query, limit=limit, order=order)
    pages = []
    while paginator.has_next:
        pages.append([s.sandbox_id for s in paginator.next_items()])
    return pages


@pytest.mark.sdk_versions  # the v2 list's query and its X-Next-Token paging
def test_listing_orders_pages_and_filters_like_e2b(server):
    tag = {"suite": "listing", "with space": "a&b c"}
    made = [Sandbox.create("base", metadata=tag, timeout=600) for _ in range(3)]
    try:
        oldest, middle, newest = made
        middle.pause()
        mine = SandboxQuery(metadata=tag)

        # Newest first, one per page, the paused one in its place by start time.
        assert every_page(mine, 1) == [[newest.sandbox_id], [middle.sandbox_id], [oldest.sandbox_id]]
        assert every_page(mine, 2) == [[newest.sandbox_id, middle.sandbox_id], [oldest.sandbox_id]]
        assert every_page(mine, 1, "asc") == [[oldest.sandbox_id], [middle.sandbox_id], [newest.sandbox_id]]
        # A full last page sends no token: the paginator stops without an empty page.
        assert every_page(mine, 3) == [[newest.sandbox_id, middle.sandbox_id, oldest.sandbox_id]]

        running = SandboxQuery(metadata=tag, state=[SandboxState.RUNNING])
        assert every_page(running, 1) == [[newest.sandbox_id], [oldest.sandbox_id]]
        paused = SandboxQuery(metadata=tag, state=[SandboxState.PAUSED])
        assert every_page(paused, 10) == [[middle.sandbox_id]]

        # startedAfter is inclusive; a second later leaves the sandbox out.
        started = newest.get_info().started_at
        assert every_page(SandboxQuery(metadata=tag, started_after=started), 10) == [[newest.sandbox_id]]
        assert every_page(SandboxQuery(metadata=tag, started_after=started + timedelta(seconds=1)), 10) == [[]]

        template = newest.get_info().template_id
        assert len(every_page(SandboxQuery(metadata=tag, template=template), 10)[0]) == 3
        assert every_page(SandboxQuery(metadata=tag, template="unknown-template"), 10) == [[]]

        # A sandbox killed between two pages does not break the second.
        api = server.api()
        first = api.get("/v2/sandboxes", params={"limit": 1, "metadata": "suite=listing"})
        assert first.json()[0]["sandboxID"] == newest.sandbox_id
        assert first.headers["x-total-running"] == "2"
        newest.kill()
        second = api.get("/v2/sandboxes", params={"limit": 1, "metadata": "suite=listing", "nextToken": first.headers["x-next-token"]})
        assert second.status_code == 200, second.text
        assert [s["sandboxID"] for s in second.json()] == [middle.sandbox_id]
        for bad in ({"order": "sideways"}, {"nextToken": "bm90IGEgdG9rZW4="}, {"template": "base:v1"}, {"startedAfter": "yesterday"}):
            reply = api.get("/v2/sandboxes", params=bad)
            assert reply.status_code == 400, (bad, reply.text)
            assert reply.json()["message"], bad
        # The deprecated v1 list: running only, newest first.
        v1 = api.get("/sandboxes", params={"metadata": "suite=listing"}).json()
        assert [s["sandboxID"] for s in v1] == [oldest.sandbox_id]
    finally:
        for s in made:
            s.kill()
