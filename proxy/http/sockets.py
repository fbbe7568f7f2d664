"""What the kernel says of a client connection's socket, and how bytes are written to it and a
connection dropped: the measures the answer-bytes count (answer_bytes.py) and a pipeline read."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios

from proxy.http.wire import out_size


def unsent_bytes(transport: asyncio.Transport | None) -> int:
    """Bytes written to the connection that its client has not yet taken: the transport's buffer and
    the kernel's send queue (SIOCOUTQ), which holds megabytes before the transport's buffer moves."""
    if transport is None:
        return 0
    unsent = int(transport.get_write_buffer_size())
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            unsent += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return unsent


def unread_bytes(transport: asyncio.Transport | None) -> int:
    """Bytes its client sent that nothing has read yet (FIONREAD): the kernel keeps them while reading
    is paused. A drain's last answer is not decided while any wait (Pipeline.last_of_drain)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return 0
    with contextlib.suppress(OSError, ValueError):
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])
    return 0


TCP_CLOSE = 7  # a socket's state once its peer reset it (linux/tcp_states.h)
TCP_CLOSE_WAIT = 8  # ...once its peer closed its side: it sends nothing more (it left, or half-closed and waits)
TCP_INFO_BYTES = 128  # struct tcp_info read up to tcpi_bytes_acked (Linux 4.1 on)
BYTES_ACKED_AT = 120


def tcp_info(transport: asyncio.Transport | None) -> tuple[int, int]:
    """The connection's TCP state and the bytes of it its peer has acknowledged (Linux's tcp_info:
    tcpi_state, tcpi_bytes_acked); (0, 0) where they cannot be read."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError, ValueError, struct.error):
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
            return info[0], struct.unpack_from("Q", info, BYTES_ACKED_AT)[0]
    return 0, 0


def aborted_if_reset(transport: asyncio.Transport | None) -> bool:
    """Whether the connection's peer reset it; if so it is closed. With its reading paused, nothing
    else would see it: what its kernel queue holds would count for its key until the keep-alive time,
    and requests it left waiting for room would be made for nobody (outside attacks: 45 requests of
    reset clients still waiting 40 s on)."""
    if transport is not None and tcp_info(transport)[0] == TCP_CLOSE:
        transport.abort()
        return True
    return False


def unsent_or_reset(transport: asyncio.Transport | None) -> int:
    """unsent_bytes, for a connection that may read nothing more: one whose peer reset it is closed (0)."""
    return 0 if aborted_if_reset(transport) else unsent_bytes(transport)


def drop(transport: asyncio.Transport) -> None:
    """Closed with a reset: what its client did not read is dropped, the kernel's copy too (a plain
    close, or abort, leaves the socket sending it for as long as the client's window stays shut)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def written(transport: asyncio.Transport, pieces: list[bytes]) -> int:
    """An answer in pieces (wire.Out: a large one's head, then its body) written to `transport`, one
    after the other (not writelines: asyncio's joins them); its size. One piece, the pipeline writes
    itself (no call on a hit's path)."""
    for piece in pieces:
        transport.write(piece)
    return out_size(pieces)
