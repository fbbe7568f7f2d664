"""The blob base fee a block's header settles (EIP-4844), on the networks whose blob schedule is known
here. Pure.

A block's blob gas price is fake_exponential(MIN_BASE_FEE_PER_BLOB_GAS, excessBlobGas, fraction):
the header holds the excess, but the update fraction is the chain's, per fork (Cancun's 3,338,477,
Prague's of EIP-7691, then the blob-parameter-only forks of EIP-7892), and no header field names it.
So a receipt's blobGasPrice is proven only where the fraction is known:

- with no excess blob gas, whatever the fraction: the minimum, 1;
- on a network of `SCHEDULES` (its chain id and genesis hash both), the fraction of the fork its
  block's timestamp falls in (the forks' times and fractions as go-ethereum's params/config.go
  holds them);
- on any other chain, EIP-4844's own fraction for a header of Cancun's layout (no requestsHash);
  none from Prague's layout on, whose fraction the chain alone knows.

Where no fraction is known, or a node shows another price (a fork after those listed here, a
devnet's own schedule), the price is left unproven: never refuted, since the table may be behind.
"""

from __future__ import annotations

from proxy.chain.headers import Header
from proxy.upstream.standing import ChainIdentity

MIN_BLOB_BASE_FEE = 1  # EIP-4844 MIN_BASE_FEE_PER_BLOB_GAS
CANCUN_FRACTION = 3_338_477  # EIP-4844 BLOB_BASE_FEE_UPDATE_FRACTION
PRAGUE_FRACTION = 5_007_716  # EIP-7691 (Osaka kept it)
BPO1_FRACTION = 8_346_193  # EIP-7892 blob-parameter-only forks: target 10, max 15
BPO2_FRACTION = 11_684_671  # target 14, max 21
# The series takes about excess/fraction terms: past e**400 wei (no chain's price) a header's excess is
# a liar's, whose price is left unproven rather than summed for ever.
MAX_EXPONENT = 400


def _forks(cancun: int, prague: int, bpo1: int, bpo2: int) -> tuple[tuple[int, int], ...]:
    """(activation timestamp, update fraction) per fork, latest first."""
    return ((bpo2, BPO2_FRACTION), (bpo1, BPO1_FRACTION), (prague, PRAGUE_FRACTION), (cancun, CANCUN_FRACTION))


# (chain id, genesis hash) -> the network's blob forks. A chain of the same id and another genesis (a
# devnet, a fork of another chain) is not one of these.
SCHEDULES: dict[tuple[int, str], tuple[tuple[int, int], ...]] = {
    (1, "0xd4e56740f876aef8c010b86a40d5f56745a118d0906a34e69aec8c0db1cb8fa3"): _forks(
        1_710_338_135, 1_746_612_311, 1_765_290_071, 1_767_747_671
    ),  # mainnet
    (11155111, "0x25a5cc106eea7138acab33231d7160d69cb777ee0c2c553fcddf5138993e6dd9"): _forks(
        1_706_655_072, 1_741_159_776, 1_761_017_184, 1_761_607_008
    ),  # Sepolia
    (17000, "0xb5f7f912443c940f21fd611f12828d75b534364ed9e95ca4e307729a4661bde4"): _forks(
        1_707_305_664, 1_740_434_112, 1_759_800_000, 1_760_389_824
    ),  # Holesky
    (560048, "0xbbe312868b376a3001692a646dd2d7d1e4406380dfd86b98aa8a34d1557c971b"): _forks(
        0, 1_742_999_832, 1_762_365_720, 1_762_955_544
    ),  # Hoodi
}


def update_fraction(chain: ChainIdentity | None, header: Header) -> int | None:
    """The blob base fee's update fraction at the header's block, or None where it is not known here."""
    forks = SCHEDULES.get((chain.chain_id, chain.genesis.lower())) if chain is not None else None
    if forks is None:
        return None if header.requests else CANCUN_FRACTION
    return next((fraction for start, fraction in forks if header.timestamp >= start), None)


def blob_base_fee(header: Header, chain: ChainIdentity | None = None) -> int | None:
    """The blob gas price the header settles on `chain` (its identity; None: a chain not known), or
    None: a block before Cancun (no excess blob gas), or a fraction not known here."""
    excess = header.excess_blob_gas
    if excess is None:
        return None
    if excess == 0:
        return MIN_BLOB_BASE_FEE
    fraction = update_fraction(chain, header)
    if fraction is None or excess > MAX_EXPONENT * fraction:
        return None
    # fake_exponential(MIN_BASE_FEE_PER_BLOB_GAS, excess, fraction) of EIP-4844.
    total, term, step = 0, MIN_BLOB_BASE_FEE * fraction, 1
    while term > 0:
        total += term
        term = term * excess // (fraction * step)
        step += 1
    return total // fraction
