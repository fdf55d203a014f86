"""The worker's rate-limited log: a warning repeated thousands of times is written once per
interval, saying how many it held back."""


def test_repeated_dead_letter_warnings_are_rate_limited():
    import logging

    from tokenfleet.ratelog import RateLimitedLog

    now = [0.0]
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("tokenfleet.test.ratelog")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    limited = RateLimitedLog(logger, interval_s=10, clock=lambda: now[0])
    for i in range(2000):
        now[0] = i * 0.01  # 2,000 in 20 s
        limited.log(logging.WARNING, "dead letter", "dead-lettering %d", i)
    assert len(records) == 2
    assert records[1].startswith("dead-lettering 1000") and "999 more" in records[1]
