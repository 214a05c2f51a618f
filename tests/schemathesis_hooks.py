"""Schemathesis hooks: lets it send archive uploads (application/x-tar), which it
cannot serialize by itself; the bytes it generates are sent as they are."""

import schemathesis


@schemathesis.serializer("application/x-tar")
class TarBytes:
    def as_requests(self, context, value):
        return {"data": value if isinstance(value, bytes) else str(value).encode()}

    def as_werkzeug(self, context, value):
        return {"data": value if isinstance(value, bytes) else str(value).encode()}
