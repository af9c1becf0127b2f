"""The gateway's canary endpoint, ``/v1/canary``: read the route, change the share, or name the next pair.

Split from ``proxy.py`` (which routes and forwards calls): this is what ``tracerl promote`` talks to.
``GET``: the route. ``POST {"fraction": f}``: a new share (1 promotes, 0 rolls back). ``POST
{"serving": "policy@6", "candidate": "policy@7"[, "fraction": f]}``: a new pair of versions, found on
the canary servers by what each says it serves now (``canary.resolve_route``); a new candidate starts
at ``--canary``'s share, the same candidate keeps its share. The route is replaced whole, so a call
in flight keeps the arm, upstream and version it started with (``canary.py``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from serving.asgi import HTTPError, json_response, parse_json
from serving.gateway.canary import CanaryRoute, parse_canary_post, resolve_route

if TYPE_CHECKING:
    from serving.gateway.proxy import Gateway

log = logging.getLogger("tracerl.gateway")


async def canary_endpoint(gw: Gateway, request: Request) -> Response:
    """``GET`` or ``POST /v1/canary`` (module docstring); 404 without a canary, 400 for a bad body,
    409 for a version no canary server serves (the route is then left as it was)."""
    if gw.route is None:
        raise HTTPError(
            404, "no canary configured; start the gateway with --canary and --upstream-for", "NotFoundError"
        )
    if request.method == "POST":
        try:
            fraction, pair = parse_canary_post(parse_json(await request.body()))
            if pair:
                gw.route = await new_pair(gw, *pair, fraction)
            elif fraction is not None:
                gw.route = gw.route.with_fraction(fraction)
        except LookupError as e:
            raise HTTPError(409, f"POST /v1/canary: {e}", "ConflictError") from e
        except ValueError as e:
            raise HTTPError(400, f"POST /v1/canary: {e}", "BadRequestError") from e
        r = gw.route
        log.warning("canary: %s at share %g beside %s", r.candidate.version, r.fraction, r.serving.version)
    r = gw.route
    return json_response(
        200, {"fraction": r.fraction, "serving": r.serving.__dict__, "candidate": r.candidate.__dict__}
    )


async def new_pair(gw: Gateway, serving: str, candidate: str, fraction: float | None) -> CanaryRoute:
    """The route for a new pair of versions, from what each canary server says it serves now."""
    views, key = {}, gw.config.upstream_api_key
    for u in gw.canary_servers:
        asked = time.monotonic()
        st = await gw.states.get(u, {"Authorization": f"Bearer {key}"} if key else {}, refresh=True)
        if st.at >= asked:  # an unreachable server serves nothing we know of (never its stale answer)
            views[u] = (st.names, st.weight_version)
    same = gw.route is not None and gw.route.candidate.version == candidate
    share = fraction if fraction is not None else gw.route.fraction if same else gw.config.canary
    return resolve_route(views, serving, candidate, float(share or 0.0))
