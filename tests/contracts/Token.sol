// SPDX-License-Identifier: MIT
pragma solidity ^0.8.0;

// Workload token (bench/workloads): ERC-20 balances and Transfer events; `scatter` pays many holders
// in one transaction so a chain with thousands of Transfer events is built in seconds.
contract Token {
    string public constant symbol = "WRK";
    uint8 public constant decimals = 18;
    uint256 public totalSupply;
    mapping(address => uint256) public balanceOf;

    event Transfer(address indexed from, address indexed to, uint256 value);

    constructor(uint256 supply) {
        totalSupply = supply;
        balanceOf[msg.sender] = supply;
        emit Transfer(address(0), msg.sender, supply);
    }

    function transfer(address to, uint256 value) external returns (bool) {
        require(balanceOf[msg.sender] >= value, "balance");
        balanceOf[msg.sender] -= value;
        balanceOf[to] += value;
        emit Transfer(msg.sender, to, value);
        return true;
    }

    // Pays `amount` to each of the `count` consecutive addresses starting at `first`.
    function scatter(uint160 first, uint256 count, uint256 amount) external {
        require(balanceOf[msg.sender] >= count * amount, "balance");
        balanceOf[msg.sender] -= count * amount;
        for (uint256 i = 0; i < count; i++) {
            address to = address(first + uint160(i));
            balanceOf[to] += amount;
            emit Transfer(msg.sender, to, amount);
        }
    }
}
