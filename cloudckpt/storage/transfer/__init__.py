"""Moving bytes: what every backend's streamed writes and ranged reads share.

Who owns which bytes, and when they go back to the window
----------------------------------------------------------
One :class:`~.window.ByteWindow` per process and size bounds the copies streamed
writes hold (invariant 9). Its bytes are *counted*, not allocated: a writer takes a
count with ``acquire`` before it holds bytes and gives it back with ``release``.

- A :class:`~.parts.PartWriter` takes two parts' worth when it opens (the object may
  still go up as one request), then one part at a time. The caller's bytes it was
  lent (``lend``: a tensor's own memory) stay the caller's, but count as bytes in
  flight until their request is answered. Copies are the writer's, in mappings the
  window hands out (``ByteWindow.mapping``).
- A part's copy belongs to the request that sends it; when the request ends (sent or
  failed), its count goes back and its mapping with it (``release(n, keep=m)``, one
  step), unless the HTTP client still holds a view of it (``exported``): then the
  mapping is unmapped when the view goes, never reused.
- The window keeps given-back mappings for reuse only while kept plus used bytes fit
  the capacity; a fresh mapping first evicts what does not. So the mappings alive stay
  within the window whenever one is made.
- A writer whose thread already holds window bytes in another open writer does not
  wait (only it can free them): the window may run over by that writer's share. A
  request larger than the whole window waits for an empty window and runs alone.

Reads hold no window: a ranged read (:mod:`.ranges`) hands each piece to the
caller's sink, or receives it straight into the caller's buffer
(:mod:`.httpget`). Batches (:mod:`.batch`) run requests on the process's I/O pool;
:mod:`.stopping` ends a failed batch's other tasks at their next piece, and
:mod:`.tally` counts each attempt for the save's report. Request bodies over the
caller's buffers are :mod:`.bodies`.
"""
