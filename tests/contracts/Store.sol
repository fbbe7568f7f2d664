// SPDX-License-Identifier: MIT
pragma solidity ^0.8.0;

// Test contract: a plain variable (slot 0), a mapping (slot 1), events and a revert with a reason.
contract Store {
    uint256 public x = 7;
    mapping(address => uint256) public bal;

    event Emitted(uint256 indexed i);

    constructor() {
        bal[msg.sender] = 42;
    }

    function setX(uint256 v) external {
        x = v;
    }

    function emitMany(uint256 n) external {
        for (uint256 i = 0; i < n; i++) {
            emit Emitted(i);
        }
    }

    function boom() external pure {
        revert("nope");
    }
}
