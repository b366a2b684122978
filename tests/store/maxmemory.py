"""``maxmemory`` cut under a pipeline of writes, for the tests of writes refused part-way
(OOM under ``noeviction``): the limit set so that the writes after it find the room
asked for, however long the server's cron takes to free its clients' buffers."""

import redis

from waiting import LIVE, wait_until


def cut(server, room):
    """``CONFIG SET maxmemory`` to what ``server`` uses plus ``room`` bytes, measured so
    that the writes after it find exactly that room. Redis counts its clients' buffers
    in what it uses: a connection that reads a command takes a 32 KiB read buffer
    (6.2: twice the 16 KiB it reads at a time), which the server's cron frees about
    0.1 s after the connection goes idle. A limit measured while the store's idle
    connections still held theirs gained their 32 KiB each once they were freed; one
    measured after lost 32 KiB to the buffer the pipeline took again (test_fault_injection's
    8 values of 4 KiB: all stored after a 0.5 s pause past the measure, none after one
    before it; the second seen on a loaded machine). So: wait until no client but this
    one holds a buffer (no query buffer, no reply pending), measure, set the limit, and
    close this connection. The writes go on a connection opened after it (a RedisStore
    of their own): a client and its read buffer, as this one, in its place in what the
    server uses (this close reaches the server before that connection does)."""
    admin = redis.Redis(unix_socket_path=server.socket, socket_timeout=LIVE)
    me = admin.client_id()
    held = ("qbuf", "qbuf-free", "obl", "oll", "omem")

    def idle():
        return all(int(c[k]) == 0 for c in admin.client_list() if int(c["id"]) != me
                   for k in held)

    wait_until(idle, "the server to free its idle clients' buffers")
    admin.config_set("maxmemory", admin.info("memory")["used_memory"] + room)
    admin.close()
