def pytest_addoption(parser):
    parser.addoption(
        "--update-table",
        action="store_true",
        default=False,
        help="rewrite the matrix table in docs/distributed.md from the results (tests/distributed/test_matrix.py)",
    )
