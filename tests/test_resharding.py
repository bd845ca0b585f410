"""The resharder's transport choice (pure; the transports themselves run in test_hybrid_engine.py)."""


def test_resharder_transport_choice():
    from megappo.parallel.reshard_transport import choose_transport

    mib = 1 << 20
    one_host = [("n0", 4096 * mib)] * 4
    assert choose_transport("auto", one_host, True, 256 * mib) == "shm"
    assert choose_transport("auto", one_host, False, 256 * mib) == "collective"  # GPU weights
    assert choose_transport("auto", [("n0", 4096 * mib), ("n1", 4096 * mib)], True, mib) == "collective"
    assert choose_transport("auto", [("n0", 64 * mib)] * 4, True, 256 * mib) == "collective"  # docker's 64 MB
    assert choose_transport("collective", one_host, True, mib) == "collective"
    try:
        choose_transport("shm", [("n0", 64 * mib)] * 4, True, 256 * mib)
        raise AssertionError("expected a refusal")
    except ValueError as e:
        assert "weight_sync_bucket_mb" in str(e) and "64 MiB free" in str(e)
