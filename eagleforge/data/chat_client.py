"""The client side of regeneration through a server (data.server_url): concurrent
/v1/chat/completions requests to an OpenAI-compatible server (vLLM, SGLang, transformers serve)
that serves the target. Standard library only (urllib, threads).

Each request is greedy (temperature 0) with max_tokens = data.max_new_tokens. Connection errors,
HTTP 429 and 5xx are retried with exponential backoff (data.max_retries times); a request whose
whole reply has not arrived within data.request_timeout_s (a deadline for the request, not for
each socket read), or any other HTTP error, stops the run with one line naming the URL; HTTP
400/413/422 refuse one prompt (e.g. longer than the server's context), which is dropped and
counted. Requests carry the API key (EAGLEFORGE_SERVER_API_KEY) to data.server_url's origin only:
a redirect within it is followed, one to another origin stops the run.

A thinking model's reasoning comes back in `reasoning_content` (or `reasoning`) when the server
runs a reasoning parser, else inline as <think>...</think> in the content; both are returned
split (split_reasoning). A reply whose message holds no text answer (content a number, a list,
null without reasoning), whose text is no Unicode (not UTF-8, a lone surrogate) or whose body is
larger than its max_tokens could make is Malformed: that prompt is dropped and counted, never
kept. Bodies are read up to a limit, never whole before it is checked, and what a server sends
is cut short in an error line.
"""

from __future__ import annotations

import functools
import http.client
import io
import json
import logging
import os
import queue
import random
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from eagleforge.data.chat import THINK_CLOSE, THINK_OPEN
from eagleforge.errors import UserInputError

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
# The server refuses this one prompt (vLLM: prompt + max_tokens longer than --max-model-len).
REJECT_STATUS = frozenset({400, 413, 422})
BACKOFF_S = 1.0  # the first wait; doubled at each retry, up to BACKOFF_MAX_S, plus up to 25% jitter
BACKOFF_MAX_S = 60.0
# The most bytes a chat reply may take: its answer is at most max_tokens tokens, a token's text a
# few to a few dozen bytes (up to 12 per character once JSON-escaped), sent once as content and
# once more if a server repeats the reasoning under both of its names. Far past that, the body is
# no answer to the request (a 50 MB reply to max_tokens=16) and is refused before it is read.
REPLY_BASE_BYTES = 1 << 20
REPLY_BYTES_PER_TOKEN = 1024
MODELS_REPLY_BYTES = 16 << 20  # GET /v1/models: a list of 100,000 names fits
ERROR_BODY_BYTES = 64 << 10  # the start of an error reply, where its message is
# A server started with --api-key wants it as a bearer token; read from the environment so it
# never lands in RUN/config.yaml.
API_KEY_ENV = "EAGLEFORGE_SERVER_API_KEY"


class ServerError(UserInputError):
    """The server failed in a way retrying does not fix, or the retries ran out; names the URL."""


class Dropped(Exception):
    """One prompt dropped for the server's reply to it, counted in stats.json under `reason`."""

    reason = verb = ""  # stats.json's reason, the warning's verb


class Rejected(Dropped):
    """The server refused one request (HTTP 400/413/422); the message has its reason."""

    reason, verb = "server_refused_prompt", "refused"


class Malformed(Dropped):
    """The server's reply to one request holds no usable answer; the message says why."""

    reason, verb = "server_reply_malformed", "sent a malformed reply to"


class _Transient(Exception):
    def __init__(self, what: str, retry_after: float | None = None):
        super().__init__(what)
        self.what, self.retry_after = what, retry_after


@dataclass
class Answer:
    content: str
    reasoning: str  # "" when the model did not reason (or the server sent none)
    completion_tokens: int | None  # the reply's usage.completion_tokens (reasoning included); None without usage
    finish_reason: str | None  # "stop" (end of turn), "length" (max_tokens reached), ...
    attempts: int  # 1 + the retries this request needed


def _time_left(deadline: float) -> float:
    """Seconds left before `deadline` (time.monotonic()); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline passed")
    return left


class _DeadlineSocket:
    """A connected socket whose every wait (send or receive) ends by the request's deadline.

    A socket timeout bounds one wait only: a server that trickles its reply (a byte every half
    second) would hold the request, and the stage, forever. Each wait here gets what is left.
    """

    def __init__(self, sock, deadline: float):
        self._sock, self._deadline = sock, deadline

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def _wait_left(self) -> None:
        self._sock.settimeout(_time_left(self._deadline))

    def sendall(self, *args):
        self._wait_left()
        return self._sock.sendall(*args)

    def makefile(self, mode="rb", *args, **kwargs):
        # The socket's own file (counted by the socket, which urllib's connection lets go of
        # before the body is read), read through _DeadlineReader.
        return io.BufferedReader(_DeadlineReader(self._sock.makefile(mode, buffering=0), self._wait_left))


class _DeadlineReader(io.RawIOBase):
    """A socket file whose every read first cuts the socket's timeout to what the deadline leaves."""

    def __init__(self, raw, wait_left):
        super().__init__()
        self._raw, self._wait_left = raw, wait_left

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self._wait_left()
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineConnection:
    """An http.client connection (mixed into HTTPConnection or HTTPSConnection) whose connect,
    sends and reads all end by `deadline`."""

    def __init__(self, *args, deadline: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self) -> None:
        self.timeout = _time_left(self.deadline)  # a redirect's second connect gets what is left
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self.deadline)


class _DeadlineHTTP(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _DeadlineHTTPS(_DeadlineConnection, http.client.HTTPSConnection):
    pass


_WITH_DEADLINE = {http.client.HTTPConnection: _DeadlineHTTP, http.client.HTTPSConnection: _DeadlineHTTPS}


class _DeadlineHandler:
    """A urllib handler (mixed into HTTPHandler or HTTPSHandler) opening deadline connections."""

    def __init__(self, deadline: float):
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class, req, **kwargs):
        return super().do_open(functools.partial(_WITH_DEADLINE[http_class], deadline=self.deadline), req, **kwargs)


class _DeadlineHTTPHandler(_DeadlineHandler, urllib.request.HTTPHandler):
    pass


class _DeadlineHTTPSHandler(_DeadlineHandler, urllib.request.HTTPSHandler):
    pass


def _origin(url: str) -> tuple:
    """(scheme, host, port) of a URL; None for a URL whose port is not a number."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        return scheme, parts.hostname, parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:
        return None


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only within the origin of the URL asked. urllib's own handler follows
    any, copying the headers: the API key would reach whatever host the server names."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if _origin(newurl) != _origin(req.full_url):
            fp.close()
            parts = urllib.parse.urlsplit(newurl)
            raise ServerError(f"{req.full_url}: HTTP {code} redirects to another origin, "
                              f"{_clip(parts.scheme + '://' + parts.netloc.rpartition('@')[2])}; requests (and the API key) "
                              "go only to data.server_url's origin: set data.server_url to the server's own address")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _opener(timeout: float) -> urllib.request.OpenerDirector:
    """urllib's opener for one request, which all of it (redirects included) must finish in `timeout` s."""
    deadline = time.monotonic() + timeout
    return urllib.request.build_opener(_DeadlineHTTPHandler(deadline), _DeadlineHTTPSHandler(deadline), _SameOriginRedirects())


def _clip(text: str, limit: int = 300) -> str:
    """Server-supplied text cut to `limit` characters for an error line."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _headers(url: str, has_body: bool) -> dict:
    """The request's headers, the API key's included; a key an HTTP header cannot carry (a line
    break would let it end the header and start another) is refused without being printed."""
    headers = {"Accept": "application/json"}
    if has_body:
        headers["Content-Type"] = "application/json"
    key = os.environ.get(API_KEY_ENV)
    if key:
        bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)
        if bad is not None:
            raise ServerError(f"{url}: the API key in {API_KEY_ENV} holds a control or non-ASCII character (character "
                              f"{bad + 1} of {len(key)}), which an HTTP header cannot carry; set the key alone, without a line break")
        headers["Authorization"] = f"Bearer {key}"
    return headers


def base_url(url: str) -> str:
    """http://host:8000, http://host:8000/v1 or .../v1/chat/completions -> http://host:8000/v1."""
    url = url.rstrip("/")
    for suffix in ("/chat/completions", "/v1"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url + "/v1"


def reply_limit(max_tokens: int) -> int:
    """The most bytes a chat reply for max_tokens tokens may take (REPLY_BYTES_PER_TOKEN)."""
    return REPLY_BASE_BYTES + REPLY_BYTES_PER_TOKEN * max_tokens


def _read_limited(reply, limit: int) -> bytes:
    """The body, never read past `limit` bytes: a larger one is Malformed (one whose Content-Length
    says so, before any of it is read)."""
    if reply.length is not None and reply.length > limit:
        raise Malformed(f"the reply is {reply.length} bytes (Content-Length), over the {limit} its request can take")
    raw = reply.read(limit + 1)
    if len(raw) > limit:
        raise Malformed(f"the reply is over {limit} bytes, more than its request can take")
    return raw


def _detail(err: urllib.error.HTTPError) -> str:
    """The server's error message (vLLM, SGLang and transformers send JSON), first line, short;
    from the start of the body only, and the connection is closed (the rest is never read)."""
    try:
        raw = err.read(ERROR_BODY_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""
    finally:
        err.close()
    message = raw
    try:
        body = json.loads(raw)
        inner = body.get("error", body) if isinstance(body, dict) else body
        message = inner.get("message", inner) if isinstance(inner, dict) else inner
    except ValueError:
        pass
    lines = str(message).strip().splitlines()
    return f" ({_clip(lines[0])})" if lines else ""


def _retry_after(headers) -> float | None:
    try:
        return max(0.0, float(headers.get("Retry-After")))
    except (TypeError, ValueError):
        return None  # absent, or an HTTP date (not worth parsing: the backoff applies)


def _request(url: str, body: dict | None, timeout: float, limit: int) -> dict:
    """One HTTP request, POST with a JSON body or GET: the JSON reply, at most `limit` bytes.

    Raises _Transient (worth retrying), Rejected or Malformed (this request only) or ServerError.
    """
    data = None if body is None else json.dumps(body, ensure_ascii=False).encode("utf-8")
    request = urllib.request.Request(url, data=data, headers=_headers(url, body is not None), method="GET" if body is None else "POST")
    timed_out = ServerError(f"{url}: no reply within {timeout:g} s (data.request_timeout_s); the server is stuck or "
                            "overloaded, or the answers need longer (raise data.request_timeout_s or lower data.concurrency)")
    try:
        with _opener(timeout).open(request, timeout=timeout) as reply:
            raw = _read_limited(reply, limit)
    except urllib.error.HTTPError as err:
        if err.code in RETRY_STATUS:
            raise _Transient(f"HTTP {err.code}{_detail(err)}", _retry_after(err.headers)) from None
        if err.code in REJECT_STATUS and body is not None:
            raise Rejected(f"HTTP {err.code}{_detail(err)}") from None
        hint = "; is data.server_model one the server serves?" if err.code == 404 else ""
        raise ServerError(f"{url}: HTTP {err.code}{_detail(err)}{hint}") from None
    except TimeoutError:  # the reply did not come (a timeout while connecting arrives as URLError)
        raise timed_out from None
    except urllib.error.URLError as err:
        if isinstance(err.reason, TimeoutError):
            raise timed_out from None
        refused = isinstance(err.reason, (ConnectionRefusedError, socket.gaierror))
        raise _Transient(f"{'cannot connect' if refused else 'connection lost'} ({_clip(str(err.reason))})") from None
    except (ConnectionError, http.client.HTTPException, OSError) as err:  # e.g. the server closed the connection
        raise _Transient(f"connection lost ({type(err).__name__}: {_clip(str(err))})") from None
    return _json_object(url, raw)


def _json_object(url: str, raw: bytes) -> dict:
    """The reply's JSON object; text that is not UTF-8 is Malformed (one reply's fault), a body
    that is not JSON a ServerError (no OpenAI-compatible server at the URL)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise Malformed(f"the reply is not UTF-8 (byte {err.start} of {len(raw)})") from None
    try:
        reply = json.loads(text)
    except ValueError:
        raise ServerError(f"{url}: the reply is not JSON: {raw[:120]!r}") from None
    if not isinstance(reply, dict):
        raise ServerError(f"{url}: the reply is not a JSON object: {raw[:120]!r}")
    return reply


def backoff_delay(attempt: int, retry_after: float | None = None) -> float:
    """Seconds to wait before retry number attempt + 1 (attempt = 0 for the first retry)."""
    delay = min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt) * (1 + 0.25 * random.random())
    return max(delay, min(retry_after, BACKOFF_MAX_S)) if retry_after is not None else delay


def request_with_retries(url: str, body: dict | None, timeout: float, max_retries: int, limit: int) -> tuple[dict, int]:
    """(the JSON reply of at most `limit` bytes, attempts made), retrying transient failures up to
    max_retries times."""
    for attempt in range(max_retries + 1):
        try:
            return _request(url, body, timeout, limit), attempt + 1
        except _Transient as err:
            if attempt == max_retries:
                raise ServerError(f"{url}: {err.what}, {attempt + 1} tries (data.max_retries={max_retries}); "
                                  "is the server up and serving?") from None
            delay = backoff_delay(attempt, err.retry_after)
            log.warning("%s: %s; retry %d of %d in %.1f s", url, err.what, attempt + 1, max_retries, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def served_model(base: str, model: str, timeout: float, max_retries: int) -> str:
    """data.server_model, or the one model the server lists at GET /v1/models."""
    if model:
        return model
    url = base + "/models"
    try:
        reply, _ = request_with_retries(url, None, timeout, max_retries, MODELS_REPLY_BYTES)
    except Dropped as err:
        raise ServerError(f"{url}: {err}") from None
    data = reply.get("data")
    names = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    if len(names) != 1 or not isinstance(names[0], str):
        raise ServerError(f"{url}: the server lists {_clip(str(names)) if names else 'no model'}; set data.server_model to the target's name")
    return names[0]


def split_reasoning(message: dict, opened: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a reply's message.

    The reasoning is `reasoning_content` (vLLM and SGLang reasoning parsers; newer vLLM also sends
    it as `reasoning`) or, from a server without a parser, the inline <think>...</think> that
    opens the content. opened: the generation prompt ends with <think> (Kimi-K2.5's does), so
    the content holds only the rest of the block, reasoning</think>answer.
    """
    content = message.get("content")
    content = content if isinstance(content, str) else ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        return reasoning, content
    head, close, tail = content.partition(THINK_CLOSE)
    if close:
        if head.lstrip().startswith(THINK_OPEN):
            return head.lstrip()[len(THINK_OPEN):], tail
        if opened and THINK_OPEN not in head:
            return head, tail
    return "", content


def _check_answer(message: dict) -> None:
    """Malformed unless the message holds an answer: content a string, reasoning (either field)
    a string or absent, and content null only beside reasoning (max_tokens reached while
    thinking). A number, list or object is no answer: split_reasoning would make it an empty one.
    Nor is a lone surrogate, which JSON escapes can spell ("\\ud800") but no file or tokenizer takes."""
    texts = {key: message.get(key) for key in ("content", "reasoning_content", "reasoning") if message.get(key) is not None}
    for key, value in texts.items():
        if not isinstance(value, str):
            raise Malformed(f"choices[0].message.{key} is {type(value).__name__}, not a string")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise Malformed(f"choices[0].message.{key} holds a lone surrogate (character {err.start})") from None
    if "content" not in texts and not any(texts.values()):
        raise Malformed("choices[0].message has neither content nor reasoning")


def _completion_tokens(usage, max_tokens: int) -> int | None:
    """usage.completion_tokens when it is a count the request could produce (an int in [0,
    max_tokens]); otherwise None (absent, negative, fractional, more than asked for), and the
    caller counts the answer's tokens itself."""
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(tokens, int) and not isinstance(tokens, bool) and 0 <= tokens <= max_tokens:
        return tokens
    return None


def chat(url: str, model: str, messages: list[dict], max_tokens: int, timeout: float, max_retries: int,
         opened: bool = False) -> Answer:
    """The greedy answer to `messages` from the chat completions endpoint `url`; opened: as for
    split_reasoning."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
    reply, attempts = request_with_retries(url, body, timeout, max_retries, reply_limit(max_tokens))
    choices = reply.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ServerError(f"{url}: a reply without choices[0].message: {json.dumps(reply)[:200]}")
    _check_answer(message)
    reasoning, content = split_reasoning(message, opened)
    return Answer(content, reasoning, _completion_tokens(reply.get("usage"), max_tokens), choice.get("finish_reason"), attempts)


def completed(items: list, fn, workers: int):
    """Yield (item, fn(item)) for every item as each completes, fn running in `workers` threads.

    The first exception fn raises is raised here and the rest is abandoned: the threads are
    daemons, so a request still in flight neither delays the exit nor has its answer used.
    """
    todo: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()
    stop = threading.Event()
    for item in items:
        todo.put(item)

    def work():
        while not stop.is_set():
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results.put((item, fn(item), None))
            except BaseException as err:  # noqa: BLE001 - handed to the consuming thread, raised there
                results.put((item, None, err))

    for index in range(min(workers, len(items))):
        threading.Thread(target=work, name=f"chat-client-{index}", daemon=True).start()
    try:
        for _ in range(len(items)):
            item, result, err = results.get()
            if err is not None:
                raise err
            yield item, result
    finally:
        stop.set()
