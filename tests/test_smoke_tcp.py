async def test_get_over_tcp(server):
    a = await server.connect()
    b = await server.connect()
    assert await a.request(b"g job") == b"1 Got Lock"
    assert await b.request(b"g job") == b"0 Cannot Get Lock"
    await a.aclose()
    assert await b.request(b"lock job 5") == b"200 Acquired"


async def test_wait_with_mock_clock(server, mock_clock):
    import trio

    a = await server.connect()
    b = await server.connect()
    assert await a.request(b"lock k ttl=10") == b"200 Acquired"
    start = trio.current_time()
    assert await b.request(b"lock k 60") == b"200 Acquired"
    assert trio.current_time() - start == 10
