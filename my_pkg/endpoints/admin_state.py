"""`AdminState`: the plugin's state in one API server, its view of the engines.

How reads stay cheap under polling (every RPC occupies the engine core between
two model steps):

* replies that cannot change while the engine lives (`my_pkg_ping`,
  `my_pkg_worker_info`, `my_pkg_config`) are fetched once and kept; they are
  dropped when the set of workers changes (another pid, another rank);
* everything that changes (`my_pkg_status`: memory, FlashHead state and
  counters, settings version) is fetched by one call at a time into a snapshot
  that reads serve while it is no older than `MY_PKG_STATUS_MAX_AGE` (age
  counted from when the call was sent) and no update was committed since it
  was asked for. A commit by this API server marks the snapshot stale at once;
  a commit by a sibling API server on the same node (`vllm serve` runs one per
  DP rank, or `--api-server-count`) is seen through the node's update marker
  (:class:`UpdateMarker`, one small file read per read), so a read after a `PUT` sees
  the new settings from whichever API server answers it. A stale snapshot is
  kept for vLLM's `/metrics` (which never waits) until the next one arrives.

What the engines hold is read off a snapshot as `held` settings, with their
ETag (:func:`etag_of`) and whether every worker agrees (:func:`consistent`).
The calls themselves are :class:`~my_pkg.endpoints.client.WorkerClient`'s.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from my_pkg.contract import STATUS, SettingsValues, WorkerStatus
from my_pkg.endpoints.audit import AuditLog
from my_pkg.endpoints.auth import TokenSet
from my_pkg.endpoints.client import SingleFlight, WorkerClient, parse_replies
from my_pkg.endpoints.config import DEFAULT_RPC_TIMEOUT, DEFAULT_STATUS_MAX_AGE, logger
from my_pkg.endpoints.errors import AdminAPIError

if TYPE_CHECKING:
    from vllm.engine.protocol import EngineClient

R = TypeVar("R", bound=BaseModel)
#: The `in_flight` key of the FlashHead update (its prepare, then its commit): one at a time per API server.
UPDATE_KEY = "flashhead_update"
#: vLLM's private directory for the multiprocess metrics of a run with several API servers.
ENV_PROMETHEUS_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True)
class StatusSnapshot:
    """Every worker's `WorkerStatus`, sorted by (dp_rank, rank), and when the call for it was sent."""

    workers: tuple[WorkerStatus, ...]
    requested_at: float  # time.monotonic()
    requested_wall_ns: int = 0  # time.time_ns(), compared with the node's update marker
    generation: int = 0  # the state's status generation when it was asked for

    @property
    def settings_version(self) -> int:
        """The engines' settings version (the highest, should they differ)."""
        return max((w.settings_version for w in self.workers), default=0)

    def held(self) -> list[dict[str, Any]]:
        """What every worker holds: its settings version and settings (see :func:`held_settings`)."""
        return held_settings(
            (w.dp_rank, w.rank, w.settings_version, SettingsValues.of_state(w.flashhead)) for w in self.workers
        )

    def age(self) -> float:
        """Seconds since the call for this snapshot was sent."""
        return max(0.0, time.monotonic() - self.requested_at)

    @property
    def worker_ids(self) -> frozenset[tuple[int, int, int | None]]:
        return worker_ids(self.workers)


def held_settings(items: Iterable[tuple[int, int, int, SettingsValues]]) -> list[dict[str, Any]]:
    """`[{dp_rank, rank, settings_version, settings}]` of every worker, sorted: what the engines hold."""
    return sorted(
        (
            {"dp_rank": dp_rank, "rank": rank, "settings_version": version, "settings": values.model_dump()}
            for dp_rank, rank, version, values in items
        ),
        key=lambda h: (h["dp_rank"], h["rank"]),
    )


def consistent(held: list[dict[str, Any]]) -> bool:
    """Every worker holds the same settings version and the same settings."""
    return len({(h["settings_version"], json.dumps(h["settings"], sort_keys=True)) for h in held}) <= 1


def etag_of(held: list[dict[str, Any]]) -> str:
    """The ETag of what the engines hold: `"<version>.<digest>"`, the digest covering every worker's version and
    settings, so any difference (an engine behind, or restarted with its defaults) is another ETag."""
    version = max((h["settings_version"] for h in held), default=0)
    digest = hashlib.sha256(json.dumps(held, sort_keys=True).encode()).hexdigest()[:12]
    return f'"{version}.{digest}"'


def worker_ids(replies: Iterable[BaseModel]) -> frozenset[tuple[int, int, int | None]]:
    """`(dp_rank, rank, pid)` of every worker that sent one of `replies`."""
    return frozenset((getattr(r, "dp_rank", 0), getattr(r, "rank", 0), getattr(r, "pid", None)) for r in replies)


class UpdateMarker:
    """A file per `vllm serve` and port holding when (`time.time_ns()`) any API server last committed an update.

    The API servers of one `vllm serve` share the port (and the engines), not memory; reading this small
    file is what a read costs to learn that a sibling committed an update after its snapshot was asked
    for. It lives in `PROMETHEUS_MULTIPROC_DIR`, the private directory vLLM makes for each run with several
    API servers (and removes at exit); with one API server there is no sibling and no file. The time is
    written into the file (file times come from a coarse clock), replaced atomically, and read only from a
    regular file of this user (never through a link).
    """

    def __init__(self, key: str, directory: str | None = None) -> None:
        directory = directory if directory is not None else os.environ.get(ENV_PROMETHEUS_MULTIPROC_DIR)
        self.path = os.path.join(directory, f"my_pkg-admin-{key}.updated") if directory else None

    def touch(self) -> None:
        if self.path is None:
            return
        temporary = f"{self.path}.{os.getpid()}"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(str(time.time_ns()))
            os.replace(temporary, self.path)
        except OSError as exc:  # a read-only directory costs siblings only the max age
            logger.debug("Could not write the update marker %s: %s", self.path, exc)

    def changed_since(self, wall_ns: int) -> bool:
        if self.path is None:
            return False
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as marker:
                info = os.fstat(marker.fileno())
                if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                    return False
                return int(marker.read(32) or 0) >= wall_ns
        except (OSError, ValueError):
            return False


class AdminState(WorkerClient):
    """The plugin's state in one API server (``app.state.my_pkg_admin``): its view of the engines.

    Its worker calls (a :class:`~my_pkg.endpoints.client.WorkerClient`) mean that routes only ever see
    validated worker replies or an :class:`AdminAPIError`; around them it keeps the caches described in
    the module docstring, the accepted tokens and this API server's share of the audit (refusals and what
    never reached an engine). ``engine_client`` is ``None`` on the CPU-only render server.
    """

    def __init__(
        self,
        engine_client: EngineClient | Any | None,
        tokens: TokenSet,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        status_max_age: float = DEFAULT_STATUS_MAX_AGE,
        *,
        marker_key: str | None = None,
        request_id_headers: bool = False,
    ) -> None:
        super().__init__(engine_client, rpc_timeout)
        self.tokens = tokens
        self.status_max_age = float(status_max_age)
        #: vLLM's `--enable-request-id-headers`: its middleware writes X-Request-Id, the plugin only reads it.
        self.request_id_headers = request_id_headers
        #: Engine-side work still running: reads keyed by what they fetch,
        #: the one FlashHead update (prepare, then commit) by ``UPDATE_KEY``.
        self.in_flight = SingleFlight()
        self.audit = AuditLog()
        self.marker = UpdateMarker(marker_key or f"pid{os.getpid()}")  # no file without sibling API servers
        core = getattr(engine_client, "engine_core", None)
        index = getattr(core, "client_index", 0)
        #: Who this API server is, in audit entries and lease holders.
        self.identity = f"{socket.gethostname()}:{os.getpid()}/api{index if isinstance(index, int) else 0}"
        self.api_server_index = index if isinstance(index, int) else 0
        self._background: set[asyncio.Future[Any]] = set()
        #: The loop the routes run on; a metrics scrape from another thread schedules refreshes on it.
        self.loop: asyncio.AbstractEventLoop | None = _running_loop()
        self._static: dict[tuple[str, tuple[Hashable, ...]], list[Any]] = {}
        self._static_generation = 0
        self._snapshot: StatusSnapshot | None = None
        self._status_generation = 0
        self._known_workers: frozenset[tuple[int, int, int | None]] | None = None
        #: Called with a snapshot whose workers differ from the previous one's (an engine restarted or joined).
        self.on_workers_changed: Callable[[StatusSnapshot], None] | None = None

    def start_background(self, work: Awaitable[Any]) -> None:
        """Run `work` on the event loop without anyone waiting for it (kept referenced until done)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- data that cannot change while the engine lives --------------------------------------

    async def static(self, method: str, model: type[R], *args: Hashable) -> list[R]:
        """The replies of ``method(*args)``, validated with ``model``: fetched once, then kept."""
        self.check_engine_alive()
        key = (method, args)
        cached = self._static.get(key)
        if cached is not None:
            return cached
        task = self.in_flight.start(("static", key, self._static_generation), lambda: self._fetch_static(key, model))
        return await self.wait(task, f"Worker RPC {method}")

    async def _fetch_static(self, key: tuple[str, tuple[Hashable, ...]], model: type[R]) -> list[R]:
        generation = self._static_generation
        method, args = key
        replies = parse_replies(method, model, await self.call_unbounded(method, *args))
        if generation == self._static_generation:  # kept even when every waiter gave up: it cannot change
            self._static[key] = replies
        return replies

    async def identity_of(self, method: str, model: type[R], snapshot: StatusSnapshot) -> list[R]:
        """Static replies of ``method`` from the workers of ``snapshot`` (fetched again if the workers changed)."""
        replies = await self.static(method, model)
        if worker_ids(replies) != snapshot.worker_ids:
            self.forget_static()
            replies = await self.static(method, model)
        return replies

    def forget_static(self) -> None:
        self._static.clear()
        self._static_generation += 1

    # ---- data that changes: one snapshot, one call at a time --------------------------------

    def _fresh(self, snapshot: StatusSnapshot | None) -> bool:
        return (
            snapshot is not None
            and snapshot.generation == self._status_generation
            and snapshot.age() <= self.status_max_age
            and not self.marker.changed_since(snapshot.requested_wall_ns)
        )

    async def status(self) -> StatusSnapshot:
        """The workers' status, no older than ``status_max_age`` and no update since (fetched when it is)."""
        self.check_engine_alive()
        snapshot = self._snapshot
        if self._fresh(snapshot):
            return snapshot
        return await self.wait(self._refresh_status(), f"Worker RPC {STATUS}")

    def last_status(self) -> StatusSnapshot | None:
        """The latest snapshot, however old or stale (None before the first one); never calls the workers."""
        return self._snapshot

    def refresh_status_soon(self) -> None:
        """Start fetching a new snapshot when the latest one is missing, too old or stale; does not wait for it.

        Runs on the event loop (a metrics scrape from another thread schedules it there).
        """
        if self.engine_client is None or getattr(self.engine_client, "errored", False) is True:
            return
        if not self._fresh(self._snapshot):
            self._refresh_status()

    def invalidate_status(self) -> None:
        """Mark the snapshot, and any still in flight, stale: the next read fetches the workers' status anew.

        The stale snapshot stays for vLLM's `/metrics` until a new one replaces it; the siblings on this
        node learn of the update through the marker.
        """
        self._status_generation += 1
        self.marker.touch()

    async def fill_at_start(self, attempts: int = 30, pause_s: float = 2.0) -> bool:
        """Fetch the first snapshot once the engines answer, so the first scrape of `/metrics` has the series.

        True once there is one; each attempt waits at most `rpc_timeout`.
        """
        for attempt in range(attempts):
            if self.engine_client is None or getattr(self.engine_client, "errored", False) is True:
                return False
            try:
                await self.wait(self._refresh_status(), f"Worker RPC {STATUS}")
                return True
            except AdminAPIError as exc:
                logger.debug("First status snapshot not available yet: %s", exc.message)
            except Exception:  # noqa: BLE001 - never let a background fill kill the loop
                logger.exception("First status snapshot failed")
            if attempt + 1 < attempts:
                await asyncio.sleep(pause_s)
        return False

    def _refresh_status(self) -> asyncio.Task[StatusSnapshot]:
        return self.in_flight.start((STATUS, self._status_generation), self._fetch_status)

    async def _fetch_status(self) -> StatusSnapshot:
        generation, requested_at, wall_ns = self._status_generation, time.monotonic(), time.time_ns()
        workers = parse_replies(STATUS, WorkerStatus, await self.call_unbounded(STATUS))
        snapshot = StatusSnapshot(tuple(workers), requested_at, wall_ns, generation)
        current = self._snapshot
        if current is None or (current.generation, current.requested_at) <= (generation, requested_at):
            self._snapshot = snapshot
        changed = self._known_workers is not None and snapshot.worker_ids != self._known_workers
        self._known_workers = snapshot.worker_ids
        if changed:
            logger.info("The engine's workers changed; fetching their identity and configuration again.")
            self.forget_static()
            if self.on_workers_changed is not None:
                self.on_workers_changed(snapshot)
        return snapshot


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
