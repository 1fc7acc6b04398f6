"""Showing a MIME bundle after a cell's output on an ipykernel, without waiting.

    publish(get_ipython().display_pub, {"text/plain": "time 1.2 ms | host 0 B"})

The per-cell report's line is sent this way: on anything but an ipykernel
(or one whose internals are not the expected ones) it is the publisher's own
`publish`. The live line (`live/`) sends its display and its updates from its
thread the same way, with the parent message of the cell it belongs to given
explicitly (`send`): ipykernel 7 would give a thread's message the latest cell's.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

_log = logging.getLogger(__name__)


def _queueable(publisher: Any) -> bool:
    """Whether `publisher` is an ipykernel's whose IOPub thread runs what we queue, in
    order, from a thread other than the one asking."""
    zmqshell = sys.modules.get("ipykernel.zmqshell")
    try:
        io_thread = publisher.pub_socket.io_thread
        thread = io_thread.thread
        return (
            zmqshell is not None
            and type(publisher).publish is zmqshell.ZMQDisplayPublisher.publish
            and not publisher._hooks
            and not getattr(publisher, "store_display_history", False)
            and thread.is_alive()
            and thread is not threading.current_thread()
            and all(getattr(s, "pub_thread", None) is io_thread for s in (sys.stdout, sys.stderr))
        )
    except AttributeError:  # not an ipykernel publisher (a capture, a test's, IPython's)
        return False


def publish(publisher: Any, bundle: dict[str, str], display_id: str | None = None) -> None:
    """Show `bundle` as one display_data, after everything the cell printed; with
    `display_id`, as the update of that display (the live line's, replaced in place).

    ipykernel's `ZMQDisplayPublisher.publish` first flushes stdout and stderr, and
    each flush from the main thread queues the flush on the IOPub thread and then
    waits for it: two cross-thread round trips per cell even with nothing buffered,
    most of what the report costs on a kernel. The IOPub thread runs what it is
    given in order, and a flush run there queues its stream message at once, so one
    queued call that flushes both streams and then sends our message keeps the
    order on the frontend without the cell waiting. This relies on ipykernel
    internals (the same in 6.17 and 7.4): anything unexpected, and anything
    `publish` would do more (transform hooks, display history), takes the plain path.
    """
    transient = {} if display_id is None else {"display_id": display_id}
    if not _queueable(publisher):
        if display_id is None:
            publisher.publish(data=bundle, metadata={})
        else:
            publisher.publish(data=bundle, metadata={}, transient=transient, update=True)
        return
    kind = "display_data" if display_id is None else "update_display_data"
    _queue(publisher, kind, bundle, transient, publisher.parent_header)


def parent_of(publisher: Any) -> dict[str, Any] | None:
    """The parent header of the cell running now, where `send` can queue messages on
    this publisher's IOPub thread later; None elsewhere. Read on the cell's own thread."""
    return dict(publisher.parent_header) if _queueable(publisher) else None


def send(publisher: Any, parent: dict[str, Any], bundle: dict[str, str], display_id: str,
         update: bool) -> None:
    """Queue a display (or its update) of `bundle` under `display_id`, as output of the
    cell whose `parent` header this is (`parent_of`), from any thread but the IOPub one;
    what the cell printed so far is flushed first (on the IOPub thread: nobody waits)."""
    kind = "update_display_data" if update else "display_data"
    _queue(publisher, kind, bundle, {"display_id": display_id}, parent)


def _queue(publisher: Any, kind: str, bundle: dict[str, str], transient: dict[str, str],
           parent: dict[str, Any]) -> None:
    session, socket, topic = publisher.session, publisher.pub_socket, publisher.topic
    content = {"data": bundle, "metadata": {}, "transient": transient}
    msg = session.msg(kind, content, parent=parent)
    streams = (sys.stdout, sys.stderr)

    def flush_then_send() -> None:  # on the IOPub thread, where flush() does not wait
        try:
            for stream in streams:
                stream.flush()
            session.send(socket, msg, ident=topic)
        except Exception:  # never break the thread's queue; the record is kept anyway
            _log.debug("a display could not be sent", exc_info=True)

    socket.io_thread.schedule(flush_then_send)
