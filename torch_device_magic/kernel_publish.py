"""Showing a MIME bundle after a cell's output on an ipykernel, without waiting.

    publish(get_ipython().display_pub, {"text/plain": "time 1.2 ms | host 0 B"})

The per-cell report's line is sent this way: on anything but an ipykernel
(or one whose internals are not the expected ones) it is the publisher's own
`publish`.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

_log = logging.getLogger(__name__)


def publish(publisher: Any, bundle: dict[str, str]) -> None:
    """Show `bundle` as one display_data, after everything the cell printed.

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
    zmqshell = sys.modules.get("ipykernel.zmqshell")
    try:
        io_thread = publisher.pub_socket.io_thread
        thread, streams = io_thread.thread, (sys.stdout, sys.stderr)
        queue = (
            zmqshell is not None
            and type(publisher).publish is zmqshell.ZMQDisplayPublisher.publish
            and not publisher._hooks
            and not getattr(publisher, "store_display_history", False)
            and thread.is_alive()
            and thread is not threading.current_thread()
            and all(getattr(s, "pub_thread", None) is io_thread for s in streams)
        )
    except AttributeError:  # not an ipykernel publisher (a capture, a test's, IPython's)
        queue = False
    if not queue:
        publisher.publish(data=bundle, metadata={})
        return
    session, socket, topic = publisher.session, publisher.pub_socket, publisher.topic
    content = {"data": bundle, "metadata": {}, "transient": {}}
    msg = session.msg("display_data", content, parent=publisher.parent_header)

    def flush_then_send() -> None:  # on the IOPub thread, where flush() does not wait
        try:
            for stream in streams:
                stream.flush()
            session.send(socket, msg, ident=topic)
        except Exception:  # never break the thread's queue; the record is kept anyway
            _log.debug("the report line could not be sent", exc_info=True)

    io_thread.schedule(flush_then_send)
