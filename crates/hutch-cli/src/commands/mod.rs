pub mod bench;
pub mod doctor;
pub mod keys;
pub mod run;
pub mod serve;
pub mod setup;
