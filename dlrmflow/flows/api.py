"""The Prefect API a command's flows report to, and one line when it cannot be reached.

With ``PREFECT_API_URL`` unset, flows run on an API this process starts itself, which is
always there. With it set, every flow run begins by talking to that server; if it does not
answer, Prefect fails inside its client with a chain of three or four tracebacks (httpcore,
httpx, then its own ``RuntimeError``). ``require_api`` asks before any work starts, and
``unreachable_api`` recognises the failure wherever it surfaces later, so that every
command says it in one line naming the URL.
"""

from __future__ import annotations

from dlrmflow.errors import DlrmflowError

# How long the health check waits for a server: a live one answers in milliseconds.
HEALTH_TIMEOUT_S = 10.0
# Prefect's own message when its client cannot reach the API (a RuntimeError).
_PREFECT_UNREACHABLE = "Failed to reach API at"


class PrefectServerError(DlrmflowError):
    """The Prefect server at ``PREFECT_API_URL`` is missing or does not answer."""


def configured_api_url() -> str | None:
    """``PREFECT_API_URL`` as Prefect's settings read it (environment or profile), or None
    when flows use this process's own ephemeral API."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or None


def _unreachable(url: str, reason: str) -> PrefectServerError:
    return PrefectServerError(
        f"Prefect API at {url} does not answer ({reason}): start the server "
        "(prefect server start) or unset PREFECT_API_URL to run on a local API"
    )


def require_api() -> None:
    """Raise ``PrefectServerError`` when ``PREFECT_API_URL`` is set and nothing answers
    there. Any HTTP answer counts (an API behind authentication answers 401); only a
    connection that cannot be made or times out is the server's absence."""
    url = configured_api_url()
    if url is None:
        return
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=HEALTH_TIMEOUT_S)
    except httpx.TransportError as e:
        raise _unreachable(url, _reason(e)) from e


def _reason(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__


def unreachable_api(error: BaseException) -> PrefectServerError | None:
    """The one-line error for ``error`` when it (or an exception it was raised from) is the
    Prefect API not answering; None for any other failure."""
    url = configured_api_url()
    if url is None:
        return None
    import httpx

    seen: set[int] = set()
    cause: BaseException | None = error
    transport: BaseException | None = None
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, httpx.TransportError) and transport is None:
            transport = cause
        elif isinstance(cause, RuntimeError) and str(cause).startswith(_PREFECT_UNREACHABLE):
            transport = transport or cause
        cause = cause.__cause__ or cause.__context__
    if transport is None:
        return None
    innermost = transport
    while isinstance(innermost.__cause__ or innermost.__context__, Exception):
        innermost = innermost.__cause__ or innermost.__context__  # type: ignore[assignment]
    return _unreachable(url, _reason(innermost if str(innermost) else transport))
