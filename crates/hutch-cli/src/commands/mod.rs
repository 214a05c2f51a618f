pub mod bench;
pub mod doctor;
pub mod exec;
pub mod keys;
pub mod remote;
pub mod run;
pub mod serve;
pub mod setup;
