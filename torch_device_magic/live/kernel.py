"""The live line on an ipykernel: one display, updated in place, sent from the sampler's
thread with the parent message of the cell it belongs to (kernel_publish.send)."""

from __future__ import annotations

import html
import uuid
from typing import Any

from ..kernel_publish import send


class KernelDisplay:
    """A display of the cell whose `parent` header is given, made at the first draw."""

    def __init__(self, publisher: Any, parent: dict[str, Any]) -> None:
        self.publisher, self.parent = publisher, parent
        self.display_id = f"tdm-live-{uuid.uuid4().hex}"
        self.shown = False
        self.written_after = False  # the cell wrote something under the display

    def draw(self, text: str) -> None:
        bundle = {
            "text/plain": text,
            "text/html": f'<div class="tdm-live" style="font-size:smaller;opacity:.7">'
            f"{html.escape(text)}</div>",
        }
        send(self.publisher, self.parent, bundle, self.display_id, update=self.shown)
        self.shown = True

    def before_write(self, text: str) -> None:
        self.written_after = True

    def erase(self) -> None:
        """Nothing to do while the cell runs: the report replaces the display at the end."""
